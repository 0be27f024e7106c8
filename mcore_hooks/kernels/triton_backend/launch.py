"""Triton launches with less of the host's work per launch: :class:`FastLaunch`.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` in Python each time: its argument binder
(the specialization of each argument, in C), then a string of the options for the cache key, the
knobs read from the environment, the launch hooks' metadata, and the compiled kernel's launcher.
At RL's small calls the host is the bottleneck, and most of a launch is not the launch: in a
log-prob call at 256 x 896 x 32000 on an H200 machine, 41-127 us a launch (timed inside the call),
of which the binder took 6-28 us and the compiled kernel's launcher 14-53
(``benchmarks/profile_calls.py --launches``).

:class:`FastLaunch` keeps Triton's binder and Triton's cache, looked up by Triton's own key (so
the kernel launched is the one Triton's launch would pick), and calls that compiled kernel's
launcher directly; the first launch of each specialization goes through Triton, which compiles
it. Triton's own path runs instead, for every launch, where something would observe the
difference: a launch or pre-run hook installed (profilers), a pipeline inspection hook, a grid
given as a function, Triton's interpreter, or a Triton release whose internals were not read
for this (:data:`_FORM_VERSIONS`; their form is also checked on the first launch, before any of
them is called).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

try:  # Triton is optional
    import triton
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
    from triton.runtime.jit import compute_cache_key as _cache_key
except ImportError:  # pragma: no cover - Triton absent, or older than this module knows
    triton = _knobs = _driver = _cache_key = None

# The Triton releases whose launch internals were read for this module: 3.6 (its direct launches
# run and measured on an H200) and 3.8 (read: its JITFunction.run, binder, cache key and
# launcher call are 3.6's); others launch through Triton's own path.
_FORM_VERSIONS = ((3, 6), (3, 8))
_HookChain = getattr(_knobs, "HookChain", None)


def _known_triton() -> bool:
    if triton is None:
        return False
    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    return major_minor in _FORM_VERSIONS


def _idle(hook: Any) -> bool:
    """Whether a launch hook would do nothing: none, or an empty chain (Triton >= 3.5's form)."""
    return hook is None or (_HookChain is not None and isinstance(hook, _HookChain) and not hook.calls)


def _plain_launches() -> bool:
    """No launch hook, no pipeline inspection hook: a launch is observed by nobody but the GPU."""
    rt = _knobs.runtime
    return (_idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)
            and getattr(rt, "add_stages_inspection_hook", None) is None)


def _with_run_options(kernel: Any, kwargs: dict) -> dict:
    """``kwargs`` with the options Triton's ``JITFunction.run`` adds before binding (part of its
    cache key)."""
    return dict(kwargs, debug=kwargs.get("debug", kernel.debug) or _knobs.runtime.debug,
                instrumentation_mode=_knobs.compilation.instrumentation_mode)


class FastLaunch:
    """A ``@triton.jit`` kernel launched as ``k[grid](*args, **kwargs)``, like the kernel itself.

    The compiled kernel is looked up in Triton's own cache by Triton's own key (its binder's
    specialization of the arguments and the launch options, ``compute_cache_key``), so a launch
    runs exactly the kernel Triton's would; nothing is cached here.
    """

    __slots__ = ("kernel", "_direct")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # None: whether this Triton's internals have the form used here is found on the first
        # launch; False: Triton's own launches only (its interpreter, another release)
        self._direct = None if _known_triton() and hasattr(kernel, "device_caches") else False

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: Any, args: tuple, kwargs: dict) -> None:
        k = self.kernel
        if self._direct is not True or callable(grid) or k.pre_run_hooks or not _plain_launches():
            k.run(*args, grid=grid, warmup=False, **kwargs)
            if self._direct is None:
                self._direct = self._has_form(args, kwargs)
            return
        device = _driver.active.get_current_device()
        caches = k.device_caches.get(device)
        kwargs = _with_run_options(k, kwargs)
        compiled = None
        if caches is not None:
            bound, spec, options = caches[4](*args, **kwargs)
            compiled = caches[0].get(_cache_key(caches[1], spec, options))
        if compiled is None or any(g.get(name, _MISSING) != value
                                   for (name, _), (value, g) in k.used_global_vals.items()):
            # Triton's own launch: compiles where needed, refuses changed globals
            k.run(*args, grid=grid, warmup=False, **kwargs)
            return
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                     _driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())

    def _has_form(self, args: tuple, kwargs: dict) -> bool:
        """After Triton's first launch: whether its per-device caches, binder and knobs have the
        form used here (checked before anything of them is called)."""
        k = self.kernel
        caches = k.device_caches.get(_driver.active.get_current_device())
        if not (caches is not None and len(caches) == 5 and callable(caches[4])
                and isinstance(caches[0], dict) and isinstance(caches[1], dict)
                and hasattr(k, "pre_run_hooks") and hasattr(k, "used_global_vals")
                and hasattr(k, "debug") and hasattr(_knobs.runtime, "debug")
                and hasattr(_knobs.compilation, "instrumentation_mode")):
            return False
        bound = caches[4](*args, **_with_run_options(k, kwargs))
        if not (isinstance(bound, tuple) and len(bound) == 3 and isinstance(bound[0], dict)
                and isinstance(bound[2], dict)):
            return False
        compiled = caches[0].get(_cache_key(caches[1], bound[1], bound[2]))
        return compiled is not None and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


_MISSING = object()
