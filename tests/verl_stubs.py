"""What verl 0.9.1's Megatron modules need on a CPU machine that cannot be had there, for
``tests/test_verl_series.py``; nothing here computes anything the tests compare.

Three stand-ins, each for a thing verl imports or asks for that has no CPU form:

* :func:`ray_stub`: the ``ray`` module. ``import verl`` reaches ``verl.protocol``, which imports
  Ray at module level and uses ``ray.ObjectRef`` in annotations; the Megatron engine's forward
  never calls Ray. (Ray's wheel would install on a CPU machine, but starts nothing here and is a
  few hundred MB: the tests use this stub, and fail, saying so, if a code path they run calls it.)
* :class:`CpuPlatform`: verl's accelerator platform (``verl.plugin.platform``), which has CUDA,
  NPU and ROCm forms only; ``MegatronEngineWithLMHead.forward_step`` moves each micro-batch to
  ``get_device_id()``, which asks CUDA for its current device. Installed through verl's own
  ``set_platform`` (its plugin interface for new hardware), after ``import verl`` (whose import
  already picked the CUDA platform, unavailable here, for its import-time flags).
* :func:`linear_cross_entropy_reference`: verl's own fused kernel
  (``verl.utils.kernel.linear_cross_entropy``, Triton, CUDA only), which verl's
  ``fused_output_processor`` calls: the same contract computed by the formula, on one TP rank.
  Installed by :func:`verl_kernel_on_cpu` in the module that calls it.

Everything else verl's Megatron modules import is the real package (``tensordict``,
``transformers``, ``peft``, ``datasets``, ``omegaconf``, ``codetiming``, ``pillow``...): see
:data:`REQUIRED` and :func:`check_requirements`.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

#: The PyPI packages verl 0.9.1's Megatron engine (``verl.workers.engine.megatron``) imports on a
#: CPU machine, beside torch and megatron-core (import name: pip requirement).
REQUIRED = {
    "tensordict": "tensordict>=0.8.0,<=0.10.0,!=0.9.0",
    "transformers": "transformers>=5.5.3,!=5.6.0,<5.11",
    "peft": "peft",
    "datasets": "datasets",
    "PIL": "pillow",
    "omegaconf": "omegaconf",
    "codetiming": "codetiming",
}


def missing_requirements() -> list[str]:
    """The pip requirements of :data:`REQUIRED` whose package is not importable here."""
    return [req for name, req in REQUIRED.items() if importlib.util.find_spec(name) is None]


def check_requirements() -> None:
    """Raise ImportError naming every missing package and the pip line that installs them."""
    missing = missing_requirements()
    if missing:
        raise ImportError(
            "verl 0.9.1's Megatron modules need these packages, missing here: "
            + ", ".join(missing)
            + "\ninstall them with: pip install "
            + " ".join(f"'{m}'" for m in missing)
        )


def ray_stub() -> types.ModuleType:
    """Stands in for ``ray`` (the Ray distributed runtime): the names verl's modules read at
    import (``ray.ObjectRef`` in annotations, ``@ray.remote`` on worker classes); any other use
    raises, naming the attribute."""

    class ObjectRef:
        """Stands in for ``ray.ObjectRef`` (only used in annotations at import)."""

    def remote(*args: Any, **kwargs: Any) -> Any:
        """Stands in for ``ray.remote``: returns the decorated class or function unchanged."""
        if args and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    class _Ray(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError(
                f"ray.{name}: verl called Ray, which tests/verl_stubs.py only stands in for "
                "(the Megatron engine's forward should not need it)"
            )

    module = _Ray("ray", "Stand-in for Ray (tests/verl_stubs.py).")
    module.ObjectRef = ObjectRef
    module.remote = remote
    module.is_initialized = lambda: False
    module.__spec__ = importlib.util.spec_from_loader("ray", loader=None)
    return module


def _cpu_platform_class() -> type:
    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """Stands in for verl's CUDA platform (``verl.plugin.platform.PlatformCUDA``): the device is
        ``"cpu"``, device management and seeding are torch's CPU ones, and profiling is a no-op."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def nvtx_range(self, msg: str):
            import contextlib

            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def get_device_uuid(self, device_id):
            return "cpu"

        def apply_model_patches(self, model_type: str) -> None:
            pass

    # the abstract members this verl release declares, whatever they are: a no-op for the rest
    for name in getattr(PlatformBase, "__abstractmethods__", ()):
        if name in CpuPlatform.__dict__:
            continue
        setattr(CpuPlatform, name, lambda self, *a, **k: None)
    CpuPlatform.__abstractmethods__ = frozenset()
    return CpuPlatform


def use_verl_tree(tree: str) -> None:
    """Import verl from ``tree`` (an unpacked sdist root) in this process: the tree first on
    ``sys.path``, Ray stood in for, and after ``import verl`` the CPU platform. Call once per
    process, before anything imports verl (each tree in a process of its own)."""
    if "verl" in sys.modules:
        loaded = getattr(sys.modules["verl"], "__file__", "") or ""
        if not loaded.startswith(tree):
            raise RuntimeError(f"verl is already imported from {loaded}, not from {tree}")
        return
    check_requirements()
    sys.path.insert(0, tree)
    sys.modules.setdefault("ray", ray_stub())
    import verl
    from verl.plugin.platform import platform_manager

    platform_manager._current_platform = _cpu_platform_class()()
    assert verl.__file__.startswith(tree), (verl.__file__, tree)


def linear_cross_entropy_reference(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """Stands in for verl's Triton ``linear_cross_entropy`` (its contract: a float temperature,
    reduction ``"none"``, ``hidden`` and ``labels`` flattened as they come; float32 1-D log-probs
    and entropies) by the formula, in float32, on one tensor-parallel rank."""
    import torch

    assert isinstance(temperature, float) and reduction == "none", (temperature, reduction)
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        raise NotImplementedError("the CPU stand-in of verl's linear_cross_entropy runs on one TP rank")
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.reshape(-1, 1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def verl_kernel_on_cpu() -> None:
    """verl's fused forward module (imported from the tree :func:`use_verl_tree` put first) calls
    :func:`linear_cross_entropy_reference` in place of its Triton kernel, in this process."""
    from verl.models.mcore import model_forward_fused

    model_forward_fused.linear_cross_entropy = linear_cross_entropy_reference
