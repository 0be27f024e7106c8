"""Options the kernels take as data (no models): how the vocabulary is split across ranks; and
what the log-prob entry point returns (:class:`LogprobEntropy`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import torch


def is_finite(x: Any) -> bool:
    """``math.isfinite`` of a real number, by comparisons: under ``torch.compile(dynamic=True)`` a
    float option may be symbolic, which comparisons take (as a guard) and ``math.isfinite``
    refuses. NaN fails both."""
    return -math.inf < x < math.inf


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


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Everything the autograd Functions take besides the differentiable ``hidden`` and
    ``weight``, checked and in the kernels' form (one argument, so their backward returns one
    ``None`` for it, never a hand-counted list).

    Attributes:
        labels: ``[N]`` long global vocabulary ids; -1 where there are none (entropy only).
        valid: ``[N]`` bool, the positions that count (label not ``ignore_index``).
        coef: ``[N]`` float32 ``logit_scale / temperature``.
        vocab_start: global id of this rank's first vocabulary row.
        group: the tensor-parallel group (None when the vocabulary is not split).
        sequence_parallel: ``hidden`` is this rank's token shard (gathered, gradient scattered).
        chunk_size: tokens per chunk of the backend's loops.
        backend: the name of the backend that runs the loops (``"torch"`` or ``"triton"``; the
            ops build the :class:`~mcore_hooks.kernels.common.autograd.Backend` where they run).
        weight_grad_accumulator: a float32 ``[V_local, H]`` tensor the weight's gradient is added
            into (Megatron's ``main_grad``) instead of being returned; None: returned as usual.
        dummy_weight_grad: with an accumulator, return a zero-stride zero tensor as the weight's
            gradient (so the weight's gradient hooks still run) rather than None.
        upstream_grad: with an accumulator, the gradient a loss's backward will receive, declared
            in advance: the losses with gradients in the forward then add ``upstream_grad * dW``
            into the accumulator there, and their backward checks the gradient it gets.
        local_labels: ``[N]`` long, the labels as rows of this rank's vocabulary shard; -1
            where the rank does not own the label or the position does not count (what the
            passes take; None only where params are made without them).
        prologue: ``(coef, ignore_index, v_total, vocab_start, v_local)`` where the prologue is
            folded into the statistics pass (:meth:`~..triton_backend.triton_fused.TritonFused.stats_with_prologue`:
            one launch less at small calls): ``valid``, ``coef`` and ``local_labels`` are then
            None until :func:`~..passes.stats_op.stats`, the params' only reader, makes them. None: they
            are made.
    """

    labels: Any
    valid: Any
    coef: Any
    vocab_start: int
    group: Optional[Any]
    sequence_parallel: bool
    chunk_size: int
    backend: Any
    weight_grad_accumulator: Optional[Any] = None
    dummy_weight_grad: bool = False
    upstream_grad: Optional[float] = None
    local_labels: Any = None
    prologue: Optional[tuple] = None

    @property
    def batch_invariant(self) -> bool:
        """Batch invariance asked for (the backend's name ends in ``+invariant``)."""
        return isinstance(self.backend, str) and self.backend.endswith("+invariant")

    @property
    def n(self) -> int:
        """Tokens (all of them under sequence parallelism)."""
        return self.labels.shape[0]


class LogprobEntropy(NamedTuple):
    """What :func:`linear_logprob_entropy` returns, per token ``[N]``.

    Attributes:
        logprob: float32 log-probability of the label (None when no labels were given).
        entropy: float32 entropy of the distribution.
        logz: float32 log of the softmax's normaliser (no gradient).
        label_is_argmax: bool, whether the label is the most likely token (None without labels;
            multi-token prediction's acceptance).
        selected: float32 ``[N, K]`` log-probabilities of ``selected_ids`` under the full
            distribution (None when none were given).
        label_outside: bool ``[N]``, with a kept set (None otherwise): the counted tokens whose
            label was not in it. Replayed (``kept_ids``), a rollout/trainer mismatch: refused
            where values are checked, else that token's results are NaN. Recomputed
            (``truncation``), the trainer's logits put the sampled token outside the engine's
            rule: the label is kept all the same. Log its mean to watch the mismatch.
    """

    logprob: Optional[torch.Tensor]
    entropy: torch.Tensor
    logz: torch.Tensor
    label_is_argmax: Optional[torch.Tensor] = None
    selected: Optional[torch.Tensor] = None
    label_outside: Optional[torch.Tensor] = None
