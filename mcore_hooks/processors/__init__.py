"""Bundled output processors: pass an instance as ``output_processor=``.

All return float32 ``[b, s]`` (a dict, or a tuple with ``as_tuple=True``, where several), never
materialise ``[tokens, vocab]`` logits, and are exact under tensor / sequence / context parallelism
and packed sequences. Subclass them (or :class:`~mcore_hooks.PostprocessProcessor`) freely.
"""

from ..postprocess import DefaultProcessor
from .fused import (
    EntropyProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
    PolicyLossProcessor,
    SelectedLogprobProcessor,
    TopKDistillationProcessor,
    megatron_upstream_grad,
)

__all__ = [
    "DefaultProcessor",
    "FusedLogprobProcessor",
    "EntropyProcessor",
    "LogprobEntropyProcessor",
    "LinearCEProcessor",
    "PolicyLossProcessor",
    "SelectedLogprobProcessor",
    "TopKDistillationProcessor",
    "megatron_upstream_grad",
]
