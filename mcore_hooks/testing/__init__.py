"""Test support for mcore-hooks: tiny stock Megatron Core models on CPU, and rank spawning.

For tests only. It builds *stock* ``GPTModel`` / ``HybridModel`` / ``MambaModel`` instances (or
subclasses with the same constructor) small enough for CPU, with batches for them, and runs code
under tensor parallelism on CPU with gloo. The CUDA-only pieces of Megatron Core are replaced by
the test-only stand-ins of :mod:`mcore_hooks.testing.cpu_shims`, which production code never
imports; they live only inside a :func:`cpu_shims` scope (entered by the builders and by
``mcore_hooks.verify``), which puts back every patched attribute on exit, never at import time.
"""

from .cpu_shims import (
    CpuCoreAttention,
    CpuNorm,
    CpuRNGStatesTracker,
    cpu_shims,
    cpu_shims_installed,
    schedule_plan_on_cpu,
)
from .distributed import DEFAULT_SEED, model_parallel, run_on_ranks
from .._quiet import KNOWN_NOTES, quiet_megatron
from .models import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    packed_sequence_slices,
    stock_model_class,
    supports_packed_sequences,
    tiny_batch,
)

__all__ = [
    "CpuCoreAttention",
    "CpuNorm",
    "CpuRNGStatesTracker",
    "DEFAULT_SEED",
    "KNOWN_NOTES",
    "TinyModelConfig",
    "available_model_classes",
    "build_tiny_model",
    "cpu_shims",
    "cpu_shims_installed",
    "model_parallel",
    "packed_sequence_slices",
    "quiet_megatron",
    "run_on_ranks",
    "schedule_plan_on_cpu",
    "stock_model_class",
    "supports_packed_sequences",
    "tiny_batch",
]
