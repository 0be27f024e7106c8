""":class:`~mcore_hooks.kernels.triton_backend.launch.FastLaunch`'s choice between a direct launch and Triton's
own, on stand-ins for Triton's kernel and driver (no GPU): Triton's path wherever its internals
are not of the form read, a grid is a function, or a hook would see the launch. (The direct
launches themselves, against Triton's: tests/test_triton_backend.py on a GPU.)"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from mcore_hooks.kernels.triton_backend import launch  # noqa: E402

pytestmark = pytest.mark.release_independent


class _Driver:
    class active:  # noqa: N801 - as Triton's driver.active
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("direct", args[:3], args[9:]))


class _Kernel:
    """Triton's JITFunction as FastLaunch reads it: per-device caches (kernel cache, key cache,
    target, backend, binder), run(), hooks, globals."""

    def __init__(self, binder_form=3):
        self.log = []
        self.pre_run_hooks, self.used_global_vals, self.debug = [], {}, False
        self.device_caches = {}
        self._binder_form = binder_form

    def _binder(self, *args, **kwargs):
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "debug", "instrumentation_mode")}
        bound = dict(enumerate(args))
        spec = [("i32", "") for _ in args]
        return (bound, spec, options)[: self._binder_form]

    def run(self, *args, grid, warmup, **kwargs):
        self.log.append(("triton", grid, args))
        # as Triton's run: the options it adds before binding, then its cache by its key
        kwargs["debug"] = kwargs.get("debug", self.debug) or launch._knobs.runtime.debug
        kwargs["instrumentation_mode"] = launch._knobs.compilation.instrumentation_mode
        caches = self.device_caches.setdefault(0, ({}, {}, None, None, self._binder))
        _, spec, options = self._binder(*args, **kwargs) + (None,) * (3 - self._binder_form)
        if self._binder_form == 3:
            caches[0][launch._cache_key(caches[1], spec, options)] = _Compiled(self.log)


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(launch, "_driver", _Driver)


def _kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_launches_go_direct_after_the_first_of_a_specialization(fake_driver, monkeypatch):
    monkeypatch.setattr(launch, "_known_triton", lambda: True)
    k = _Kernel()
    fl = launch.FastLaunch(k)
    for _ in range(3):
        fl[(4, 2)](1, 2, num_warps=4)
    assert _kinds(k) == ["triton", "direct", "direct"] and fl._direct is True
    assert k.log[-1][1] == (4, 2, 1) and k.log[-1][2] == (1, 2)  # the grid padded, the arguments bound
    fl[(4,)](1, 2, num_warps=8)  # other options: another key, Triton's path (it compiles)
    fl[(4,)](1, 2, num_warps=8)
    assert _kinds(k)[3:] == ["triton", "direct"]


def test_tritons_path_where_a_launch_would_be_seen_or_the_grid_is_a_function(fake_driver, monkeypatch):
    monkeypatch.setattr(launch, "_known_triton", lambda: True)
    k = _Kernel()
    fl = launch.FastLaunch(k)
    fl[(1,)](7)
    fl[lambda meta: (1,)](7)  # a grid function: Triton's
    k.pre_run_hooks.append(lambda *a, **kw: None)
    fl[(1,)](7)
    k.pre_run_hooks.clear()
    seen = ["triton"] * 3
    if launch._HookChain is not None:  # Triton >= 3.5's hook chains
        hook = lambda metadata: None  # noqa: E731
        launch._knobs.runtime.launch_enter_hook.add(hook)
        try:
            fl[(1,)](7)
        finally:
            launch._knobs.runtime.launch_enter_hook.remove(hook)
        seen.append("triton")
    k.used_global_vals[("G", 0)] = (1, {"G": 2})  # a global changed since compiling: Triton's (it refuses)
    fl[(1,)](7)
    k.used_global_vals.clear()
    fl[(1,)](7)
    assert _kinds(k) == seen + ["triton", "direct"]


def test_an_unknown_form_or_release_launches_through_triton(fake_driver, monkeypatch):
    monkeypatch.setattr(launch, "_known_triton", lambda: True)
    k = _Kernel(binder_form=2)  # a binder of another release's form
    fl = launch.FastLaunch(k)
    for _ in range(3):
        fl[(1,)](7)
    assert fl._direct is False and _kinds(k) == ["triton"] * 3

    monkeypatch.setattr(launch, "_known_triton", lambda: False)  # a release not read
    k = _Kernel()
    fl = launch.FastLaunch(k)
    for _ in range(3):
        fl[(1,)](7)
    assert fl._direct is False and _kinds(k) == ["triton"] * 3

    class NoCaches:  # the interpreter's kernels: no per-device caches
        def __init__(self):
            self.calls = 0

        def __getitem__(self, grid):
            raise AssertionError("not used")

        def run(self, *args, grid, warmup, **kwargs):
            self.calls += 1

    monkeypatch.setattr(launch, "_known_triton", lambda: True)
    nc = NoCaches()
    fl = launch.FastLaunch(nc)
    fl[(1,)](7)
    assert fl._direct is False and nc.calls == 1


def test_the_releases_read_are_the_ones_named():
    import triton

    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2])
    assert launch._known_triton() is (major_minor in launch._FORM_VERSIONS)
