"""Test support for mcore-hooks: tiny stock Megatron Core models on CPU, and rank spawning.

For tests only. It builds *stock* ``GPTModel`` / ``HybridModel`` / ``MambaModel`` instances (or
subclasses with the same constructor) small enough for CPU, with batches for them, and runs code
under tensor parallelism on CPU with gloo. The CUDA-only pieces of Megatron Core are replaced by
the test-only stand-ins of :mod:`mcore_hooks.testing.shims`, which production code never
imports; they live only inside a :func:`cpu_shims` scope (entered by the builders and by
``mcore_hooks.verify``), which puts back every patched attribute on exit, never at import time.
"""

import importlib
from typing import Any

# Lazy (PEP 562): `from mcore_hooks.testing import quiet_megatron` imports no Megatron Core, so a
# script can silence Megatron's notes before the rest of this package imports it. No export may
# share a submodule's name: importing that submodule would rebind the name to the module.
_WHERE = {
    "CpuCoreAttention": ".shims",
    "CpuNorm": ".shims",
    "CpuRNGStatesTracker": ".shims",
    "cpu_shims": ".shims",
    "cpu_shims_installed": ".shims",
    "schedule_plan_on_cpu": ".shims",
    "DEFAULT_SEED": ".distributed",
    "model_parallel": ".distributed",
    "run_on_ranks": ".distributed",
    "hook_keywords": ".hook_call",
    "KNOWN_NOTES": "mcore_hooks._quiet",
    "quiet_megatron": "mcore_hooks._quiet",
    "TinyModelConfig": ".models",
    "available_model_classes": ".models",
    "build_tiny_model": ".models",
    "packed_sequence_slices": ".models",
    "stock_model_class": ".models",
    "supports_packed_sequences": ".models",
    "tiny_batch": ".models",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _WHERE[name]
    value = getattr(importlib.import_module(module, __name__ if module.startswith(".") else None), name)
    globals()[name] = value
    return value


__all__ = [
    "CpuCoreAttention",
    "CpuNorm",
    "CpuRNGStatesTracker",
    "DEFAULT_SEED",
    "hook_keywords",
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


def __dir__() -> list[str]:
    return sorted(__all__)
