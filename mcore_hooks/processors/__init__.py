"""Bundled output processors: pass an instance as ``output_processor=``.

All return float32 ``[b, s]`` (a dict, or a tuple with ``as_tuple=True``, where several), never
materialise ``[tokens, vocab]`` logits, and are exact under tensor / sequence / context parallelism
and packed sequences. Subclass them (or :class:`~mcore_hooks.PostprocessProcessor`) freely.
One family a module: :mod:`.logprob`, :mod:`.losses`, :mod:`.selected`, over the base in
:mod:`.fused`.
"""

from ..postprocess import DefaultProcessor
from .logprob import EntropyProcessor, FusedLogprobProcessor, LogprobEntropyProcessor
from .losses import LinearCEProcessor, PolicyLossProcessor, megatron_upstream_grad
from .selected import SelectedLogprobProcessor, TopKDistillationProcessor

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
