"""Options the kernels take as data (no models): how the vocabulary is split across ranks."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """How this rank's output weight and hidden states relate to the whole.

    Attributes:
        group: the tensor-parallel group the vocabulary is split over (None: not split).
        vocab_start: the global id of this rank's first vocabulary row (Megatron gives every
            rank ``padded_vocab / tp`` rows, so ``tp_rank * weight.shape[0]``).
        sequence_parallel: the hidden states are this rank's token shard (Megatron's sequence
            parallelism): gathered in the forward, their gradient reduce-scattered.
    """

    group: Optional[Any] = None
    vocab_start: int = 0
    sequence_parallel: bool = False
