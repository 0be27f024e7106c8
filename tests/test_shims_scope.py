"""Nothing of the CPU stand-ins outlives their scope: after the test builders and after
``mcore_hooks.verify``, every attribute of every Megatron Core module is the original object.

Each check runs in a fresh process that sets up Megatron's parallel state itself (as a user's
program would), so no other test's scope is open around it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
from typing import Any, Callable

import torch


def _megatron_attributes() -> dict[str, Any]:
    """Every module-level attribute of every imported Megatron Core module, by dotted name."""
    return {
        f"{name}.{attr}": value
        for name, module in list(sys.modules.items())
        if name.startswith("megatron") and module is not None
        for attr, value in list(vars(module).items())
    }


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in before.items() if after.get(k, v) is not v)


def _own_parallel_state() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def _after_verify() -> tuple[bool, list[str], list[str]]:
    import mcore_hooks.verify as verify
    from mcore_hooks.testing import cpu_shims

    _own_parallel_state()
    before = _megatron_attributes()
    rows = verify.run_checks(verify.PROCESSOR_CHECKS[:4], model_classes=["gpt"])
    with cpu_shims():
        inside = _changed(before, _megatron_attributes())
    return all(r.passed for r in rows), inside, _changed(before, _megatron_attributes())


def _after_builders() -> tuple[list[str], list[str]]:
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, cpu_shims, tiny_batch

    _own_parallel_state()
    before = _megatron_attributes()
    cfg = TinyModelConfig()
    build_tiny_model(cfg)(**tiny_batch(cfg)).sum().backward()  # outside any scope
    after_build = _changed(before, _megatron_attributes())
    with cpu_shims():
        with cpu_shims():  # nested: the outer scope owns the patches
            build_tiny_model(cfg)(**tiny_batch(cfg)).sum().backward()
        still_inside = bool(_changed(before, _megatron_attributes()))
    return after_build + ([] if still_inside else ["<inner scope restored early>"]), _changed(
        before, _megatron_attributes()
    )


def _in_fresh_process(fn: Callable[[], Any]) -> Any:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn).result(timeout=300)


def test_verify_leaves_megatron_as_found():
    passed, inside, changed = _in_fresh_process(_after_verify)
    assert passed
    # the scope does patch (so the check below can see a leak) ...
    assert "megatron.core.tensor_parallel.mappings.torch" in inside
    assert "megatron.core.tensor_parallel.random.CudaRNGStatesTracker" in inside
    # ... and nothing is left patched after verify's checks
    assert changed == []


def test_builders_leave_megatron_as_found():
    after_build, after_scope = _in_fresh_process(_after_builders)
    assert after_build == [] and after_scope == []


def _after_library_use() -> list[str]:
    import megatron.core.models.gpt.gpt_model  # noqa: F401

    before = _megatron_attributes()
    import mcore_hooks
    from mcore_hooks.kernels import linear_logprob_entropy

    mcore_hooks.hooked_class(mcore_hooks.compat.language_model_classes()["GPTModel"])
    linear_logprob_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]))
    return _changed(before, _megatron_attributes())


def test_importing_and_using_the_library_patches_nothing():
    assert _in_fresh_process(_after_library_use) == []


def _lazy_exports_after_submodule_imports() -> list[str]:
    # Importing a submodule binds its name on the package; no export may share a submodule's name,
    # or `from mcore_hooks.testing import X` would depend on what was imported first.
    import importlib

    import mcore_hooks.testing as testing

    for sub in ("shims", "distributed", "hook_call", "models"):
        importlib.import_module(f"mcore_hooks.testing.{sub}")
    return [name for name in testing.__all__ if type(getattr(testing, name)).__name__ == "module"]


def test_testing_exports_do_not_depend_on_import_order():
    assert _in_fresh_process(_lazy_exports_after_submodule_imports) == []
