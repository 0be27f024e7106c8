"""Where one call's time goes: the host's Python work per call at small shapes (cProfile over
back-to-back calls) and the device's kernels at large ones (``torch.profiler``), one GPU.

    python benchmarks/profile_calls.py --host [--shape 256 896 32000]
    python benchmarks/profile_calls.py --kernels [--shape 16384 4096 151936] [--paths lp stock_lp]
    python benchmarks/profile_calls.py --host-parts [--shape 256 896 32000]
    python benchmarks/profile_calls.py --launches [--shape 256 896 32000] [--paths lp policy]
    python benchmarks/profile_calls.py --descriptors [--shape 256 896 32000] [--paths lp policy]
    python benchmarks/profile_calls.py --tma-threshold [--shape 512 2048 32000] [--paths lp ce]
    python benchmarks/profile_calls.py --dw-routes [--shape 1024 4096 151936]
    python benchmarks/profile_calls.py --timeline [--shape 256 896 32000]

``--host`` also times the floor under the library: an empty Triton kernel's launch with as many
arguments as the statistics kernel takes, and a tensor descriptor's construction.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time

import torch

import bench_sweep


def _inputs(n: int, h: int, v: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x, w, y, torch.zeros(v, h, device="cuda")


def _host_ms(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return t


def _runs(shape, paths, liger=None):
    """``(name, run)`` for each of bench_sweep's entry paths named (a call forward+backward,
    the gradients cleared first); a path not there is reported and skipped."""
    x, w, y, main_grad = _inputs(*shape)
    table = bench_sweep.entry_paths(x, w, y, main_grad, liger)
    for name in paths:
        if name not in table:
            print(f"=== {name}: not available")
            continue

        def run(step=table[name]):
            x.grad = w.grad = None
            step()

        yield name, run


def host(shape, paths, calls: int = 60) -> None:
    for name, run in _runs(shape, paths):
        for _ in range(5):
            run()
        ms = min(_host_ms(run, calls) for _ in range(3))
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(calls):
            run()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"=== {name} at {shape}: host {ms:.3f} ms a call (back-to-back, {calls} calls)")
        print("\n".join(s.getvalue().splitlines()[6:]))
        # the host's time by torch operation and autograd node (the Python between them is
        # the eager autograd Functions' self time)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for _ in range(50):
                run()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, BLOCK: tl.constexpr):
        pass

    @triton.jit
    def _empty3(a, b, n, BLOCK: tl.constexpr):
        pass


def launch_floor() -> None:
    empty = _empty
    z = torch.zeros(16, device="cuda")
    args = [z] * 8 + [7, 4096, 151936, 1, 2, 3, 9, 11, 64, 16, 5, 13]
    empty[(1,)](*args, BLOCK=16)
    print(f"empty Triton launch, 20 arguments: {_host_ms(lambda: empty[(1,)](*args, BLOCK=16), 2000) * 1e3:.1f} us")
    print(f"empty torch op (torch.empty): {_host_ms(lambda: torch.empty(16, device='cuda'), 2000) * 1e3:.1f} us")
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return
    a = torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16)
    print(f"TensorDescriptor.from_tensor: {_host_ms(lambda: TensorDescriptor.from_tensor(a, [128, 64]), 2000) * 1e3:.1f} us")
    da = TensorDescriptor.from_tensor(a, [128, 64])
    _empty3[(1,)](da, da, 5, BLOCK=16)
    _empty3[(1,)](a, a, 5, BLOCK=16)
    print(f"empty launch, 3 arguments: two descriptors {_host_ms(lambda: _empty3[(1,)](da, da, 5, BLOCK=16), 2000) * 1e3:.1f} us, "
          f"two pointers {_host_ms(lambda: _empty3[(1,)](a, a, 5, BLOCK=16), 2000) * 1e3:.1f} us")


def launch_parts() -> None:
    """An empty 20-argument launch taken apart: Triton's argument binder, and the compiled
    kernel's own launcher called directly (Triton's internals: a probe, not for library use)."""
    from triton import knobs
    from triton.runtime import driver

    z = torch.zeros(16, device="cuda")
    args = [z] * 8 + [7, 4096, 151936, 1, 2, 3, 9, 11, 64, 16, 5, 13]
    compiled = _empty[(1,)](*args, BLOCK=16)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    try:
        binder = _empty.device_caches[device][-1]
        opts = dict(BLOCK=16, debug=False, instrumentation_mode="")
        print(f"  Triton's argument binder: {_host_ms(lambda: binder(*args, **opts), 2000) * 1e3:.1f} us")
        values = args + [16]  # the constexpr too, as the launcher takes the bound arguments

        def direct():
            compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                         knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)

        print(f"  the compiled kernel's launcher, called directly: {_host_ms(direct, 2000) * 1e3:.1f} us")
    except (TypeError, AttributeError, KeyError) as e:  # another Triton's internals
        print(f"  the binder or the compiled kernel's launcher: not callable here ({e})")


def host_parts(shape) -> None:
    """Where the host time of a log-prob call (forward + backward) goes: the call, its forward
    with and without a graph, each Triton launch timed inside the call, and the call with the
    launches replaced by no-ops; beside a bare product with its backward."""
    import collections

    from mcore_hooks.kernels import linear_logprob_entropy
    from mcore_hooks.kernels.triton_backend import triton_fused, triton_rows

    x, w, y, _ = _inputs(*shape)

    def full():
        x.grad = w.grad = None
        r = linear_logprob_entropy(x, w, y)
        (r.logprob.sum() + r.entropy.sum()).backward()

    def forward():
        linear_logprob_entropy(x, w, y)

    def no_grad():
        with torch.no_grad():
            linear_logprob_entropy(x, w, y)

    def bare():
        x.grad = w.grad = None
        (x @ w.t()).float().sum().backward()

    def best(fn, calls=300):
        for _ in range(20):
            fn()
        return min(_host_ms(fn, calls) for _ in range(5))

    print(f"=== host time of linear_logprob_entropy at {shape}, ms a call (back-to-back)")
    print(f"  forward + backward {best(full):.3f}; forward {best(forward):.3f}; forward without "
          f"grad {best(no_grad):.3f}; a bare x @ w.T, float, backward {best(bare):.3f}")
    times = collections.defaultdict(list)
    kernels = [(m, k, v) for m in (triton_fused, triton_rows) for k, v in list(vars(m).items())
               if k.startswith("_") and k.endswith("_kernel")]

    class Timed:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*a, **kw):
                t0 = time.perf_counter()
                launch(*a, **kw)
                times[self.name].append((time.perf_counter() - t0) * 1e6)

            return run

    class NoOp:
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    try:
        for m, k, v in kernels:
            setattr(m, k, Timed(v, k))
        for _ in range(50):
            full()
        torch.cuda.synchronize()
        times.clear()
        for _ in range(200):
            full()
        torch.cuda.synchronize()
        for k, t in times.items():
            t.sort()
            print(f"  {k}: {t[len(t) // 2]:.1f} us a launch inside the call (median), {t[0]:.1f} least")
        for m, k, v in kernels:
            setattr(m, k, NoOp())
        print(f"  launches replaced by no-ops: forward + backward {best(full):.3f}; forward without "
              f"grad {best(no_grad):.3f}")
    finally:
        for m, k, v in kernels:
            setattr(m, k, v)


def launches(shape, paths, rounds: int = 8) -> None:
    """The launches of small calls, with :class:`~mcore_hooks.kernels.triton_backend.launch.FastLaunch`'s direct
    launches and with Triton's own: each launch inside a call taken apart under Triton's path
    (its argument binder, the compiled kernel's launcher, the rest of ``JITFunction.run``; from
    Triton's internals, a probe), then each path's host time a call (back-to-back), the two
    modes interleaved ``rounds`` times in one process (the host's time moves by a tenth and
    more between samples), the median and the least of each."""
    import collections
    import statistics

    from triton.runtime import driver

    from mcore_hooks.kernels.triton_backend import launch, triton_fused, triton_rows

    direct = launch.FastLaunch._launch

    def tritons(self, grid, args, kwargs):
        self.kernel[grid](*args, **kwargs)

    runs = dict(_runs(shape, paths))
    parts = collections.defaultdict(float)
    count = collections.Counter()

    def timed(f, label):
        def g(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                parts[label] += time.perf_counter() - t0
                count[label] += 1
        return g

    launch.FastLaunch._launch = tritons
    device = driver.active.get_current_device()
    wrapped, launchers = [], []
    try:
        for run in runs.values():
            for _ in range(5):
                run()
        wrapped = [(m, k, v, v.kernel.device_caches[device]) for m in (triton_fused, triton_rows)
                   for k, v in list(vars(m).items())
                   if isinstance(v, launch.FastLaunch) and device in v.kernel.device_caches]
        for m, k, fl, caches in wrapped:
            fl.kernel.device_caches[device] = (*caches[:-1], timed(caches[-1], (k, "binder")))
            for ck in caches[0].values():
                ck._init_handles()
                launchers.append((ck, ck._run))
                ck._run = timed(ck._run, (k, "launcher"))
            setattr(m, k, type("Timed", (), {"__getitem__": lambda self, grid, fl=fl, k=k: timed(fl.kernel[grid], (k, "all"))})())
        for name, run in runs.items():
            parts.clear()
            count.clear()
            for _ in range(200):
                run()
            torch.cuda.synchronize()
            print(f"=== {name} at {shape}: Triton's launches taken apart, us a launch (with the timers)")
            for k in sorted({k for k, _ in parts}):
                c = count[(k, "all")]
                a, b, r = (parts[(k, part)] * 1e6 / c for part in ("all", "binder", "launcher"))
                print(f"  {k:26s} {a:6.1f}: binder {b:5.1f}, compiled kernel's launcher {r:5.1f}, "
                      f"the rest of JITFunction.run {a - b - r:5.1f}  ({c // 200} a call)")
    finally:  # the timers out again: the host times below are of the bare launches
        for m, k, fl, caches in wrapped:
            setattr(m, k, fl)
            fl.kernel.device_caches[device] = caches
        for ck, run in launchers:
            ck._run = run
        launch.FastLaunch._launch = direct
    for name, run in runs.items():
        times = {"Triton's": [], "direct": []}
        for _ in range(rounds):
            for mode, f in (("Triton's", tritons), ("direct", direct)):
                launch.FastLaunch._launch = f
                times[mode].append(_host_ms(run, 200))
        launch.FastLaunch._launch = direct
        print(f"=== {name} at {shape}, host ms a call: " + "; ".join(
            f"{mode} launches median {statistics.median(t):.3f}, least {min(t):.3f}" for mode, t in times.items()),
            flush=True)


TMA_SHAPES = [(256, 2048, 32000), (256, 4096, 32000), (256, 8192, 32000), (512, 2048, 32000),
              (512, 4096, 32000), (512, 8192, 32000), (2048, 2048, 32000), (256, 2048, 151936),
              (512, 1536, 151936), (1024, 4096, 32000)]


def descriptors(shapes, paths, thresholds=None, rounds: int = 3) -> None:
    """Values of ``triton_fused._TMA_MIN_WORK`` (products below it load their operands by
    pointers, not tensor descriptors) interleaved ``rounds`` times in one process: each path's
    GPU time (its kernels' sum; medians), wall (``do_bench``'s median; medians) and host ms a
    call (20 calls back to back; the least). ``thresholds``: by default descriptors at any size
    (0) against this tree's rule."""
    import statistics

    import triton.testing

    from mcore_hooks.kernels.triton_backend import triton_fused

    rule = triton_fused._TMA_MIN_WORK
    thresholds = thresholds or (0, rule)
    print("work / 2^34: " + ", ".join(f"{n}x{h}x{v}={n * h * v / 2**34:.1f}" for n, h, v in shapes)
          + "; thresholds / 2^34: " + ", ".join(f"{t / 2**34:g}" for t in thresholds), flush=True)
    try:
        for shape in shapes:
            for name, run in _runs(shape, paths):
                got = {t: ([], [], []) for t in thresholds}
                for _ in range(rounds):
                    for t in thresholds:
                        triton_fused._TMA_MIN_WORK = t
                        for _ in range(5):
                            run()
                        torch.cuda.synchronize()
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            run()
                            torch.cuda.synchronize()
                        got[t][0].append(bench_sweep._kernels(prof)[0])
                        got[t][1].append(triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median"))
                        got[t][2].append(_host_ms(run, 20))
                print(f"=== {name} at {shape}: " + "; ".join(
                    f"from {t / 2**34:g} x 2^34: GPU {statistics.median(g):.3f} ms, wall "
                    f"{statistics.median(w):.3f}, host {min(h):.3f}" for t, (g, w, h) in got.items()),
                    flush=True)
    finally:
        triton_fused._TMA_MIN_WORK = rule


def kernels(shape, paths) -> None:
    for name, run in _runs(shape, paths, bench_sweep._liger()):
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        rows = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ms = (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / 1e3
                k = rows.setdefault(e.name[:70], [0, 0.0])
                k[0] += 1
                k[1] += ms
        total = sum(ms for _, ms in rows.values()) / 3
        print(f"=== {name} at {shape}: {total:.2f} ms of kernels a call")
        for k, (c, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            print(f"  {ms / 3:8.2f} ms  {c // 3:4d}x  {k}")


def dx_tiles(shape) -> None:
    """The hidden gradient's kernel (``dz @ W`` over the whole vocabulary as one chunk, the
    first chunk's form and a later chunk's, which adds a carried float32 sum) with candidate
    tiles, beside cuBLAS's product."""
    import dataclasses

    import triton.testing

    from mcore_hooks.kernels.triton_backend import triton_fused as tf
    from mcore_hooks.kernels.triton_backend import triton_tiles as tt

    n, h, v = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = (torch.randn(n, v, device="cuda", generator=g) * 1e-3).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    out = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(n, h, device="cuda")
    flop = 2 * n * h * v

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    t = bench(lambda: torch.mm(dz, w, out=out))
    print(f"=== dX at {shape}: cuBLAS {t:.2f} ms ({flop / t / 1e9:.0f} TFLOP/s)")
    ref = None
    for cfg in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 16, 3),
                (256, 128, 64, 16, 3), (128, 128, 128, 8, 2), (64, 256, 64, 4, 3), (128, 64, 64, 4, 4)]:
        be = tf.TritonFused(dataclasses.replace(tt.TILES[0], dx=tt.Tile(*cfg)))
        try:
            be.hidden_grad(dz, w, out)
            same = "" if ref is None else ("same bits" if torch.equal(out, ref) else "OTHER BITS")
            ref = out.clone() if ref is None else ref
            t = bench(lambda: be.hidden_grad(dz, w, out))
            seg = tf.dx_segment(v)
            t_cont = bench(lambda: be._hidden_grad(dz, w, seg, acc, out))  # a later chunk's form
            print(f"  dx tile {cfg}: {t:.2f} ms ({flop / t / 1e9:.0f} TFLOP/s) {same}; with a float32 "
                  f"sum carried in (a later chunk): {t_cont:.2f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported
            print(f"  dx tile {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


def dw_routes(shape) -> None:
    """The two routes of a fused loss's weight gradient at one shape: from the logit gradient
    kept for the backward (scaled by the upstream gradient, then cuBLAS's product:
    ``loss_op._weight_grad``), against the forward route's float32 product and its scaling
    pass in the backward; each also into a float32 ``main_grad``."""
    import triton.testing

    from mcore_hooks.kernels.triton_backend import triton_fused as tf
    from mcore_hooks.kernels.passes.loss_op import _weight_grad, accumulate_weight_grad_
    from mcore_hooks.kernels.common.matmul import mm_f32

    n, h, v = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    dz = (torch.randn(n, v, device="cuda", generator=g) * 1e-3).bfloat16()
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    grad = torch.tensor(0.5, device="cuda")
    w32 = torch.empty(v, h, device="cuda")
    acc = torch.zeros(v, h, device="cuda")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    kept = bench(lambda: _weight_grad(dz, x, grad))
    kept_acc = bench(lambda: accumulate_weight_grad_(acc, dz, x, grad))
    t_mm = bench(lambda: mm_f32(dz.t(), x, out=w32))  # one chunk: beta 0
    t_cast = bench(lambda: tf.TritonFused.scale_cast(w32, grad, torch.bfloat16))
    t_add = bench(lambda: tf.TritonFused.scale_accumulate(w32, grad, acc))
    print(f"=== dW at {shape}: kept logit gradient {kept:.2f} ms (into main_grad {kept_acc:.2f}); "
          f"forward route {t_mm + t_cast:.2f} ms (into main_grad {t_mm + t_add:.2f}: float32 "
          f"product {t_mm:.2f}, scaling {t_cast:.2f} / {t_add:.2f})", flush=True)


def timeline(shape, calls: int = 300) -> None:
    """A log-prob call's host time stage by stage: timestamps (``time.perf_counter``) at the
    entry and exit of each layer of the call, forward and backward, and around each launch,
    over back-to-back calls; the median gap between consecutive marks. Beside it, a bare
    autograd Function of the same two outputs under the same sum and backward (the floor the
    engine and the caller's own ops set), and that floor with the backward's allocations and
    product (the work around the launches that the backward cannot skip)."""
    import collections
    import statistics

    import mcore_hooks.kernels as K
    from mcore_hooks.kernels.common import dispatch
    from mcore_hooks.kernels.triton_backend import launch, triton_fused
    from mcore_hooks.kernels.passes import stats_op

    x, w, y, _ = _inputs(*shape)
    marks: list = []
    clock = time.perf_counter

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            marks.append((label + ">", clock()))
            try:
                return fn(*a, **kw)
            finally:
                marks.append(("<" + label, clock()))

        setattr(owner, name, timed)
        return owner, name, fn

    op = stats_op.logsoftmax_stats
    setup, backward = dispatch._AUTOGRAD[op]
    names = {}

    def launch_timed(self, grid, args, kwargs, _fn=launch.FastLaunch._launch):
        label = names.setdefault(id(self), getattr(self.kernel, "__name__", None) or repr(self.kernel))
        marks.append((label + ">", clock()))
        _fn(self, grid, args, kwargs)
        marks.append(("<" + label, clock()))

    def backward_timed(ctx, *g):
        marks.append(("backward>", clock()))
        try:
            return backward(ctx, *g)
        finally:
            marks.append(("<backward", clock()))

    def call():
        x.grad = w.grad = None
        marks.append(("call>", clock()))
        r = K.linear_logprob_entropy(x, w, y)
        marks.append(("<call", clock()))
        loss = r.logprob.sum() + r.entropy.sum()
        marks.append(("sum", clock()))
        loss.backward()
        marks.append(("<.backward()", clock()))

    restore = []
    saved_launch = launch.FastLaunch._launch
    try:  # each patch undone in the finally, whichever came before a failure
        for owner, name, label in ((K, "_prepare", "prepare"), (stats_op, "stats", "stats_op"),
                                   (triton_fused.TritonFused, "stats", "fused.stats"),
                                   (triton_fused.TritonFused, "stats_with_prologue", "fused.stats"),
                                   (triton_fused.TritonFused, "grads", "grads"),
                                   (triton_fused.TritonFused, "_hidden_grad", "dx")):
            restore.append(wrap(owner, name, label))
        launch.FastLaunch._launch = launch_timed
        # the op's backward: marked where the op's path runs (the one-rank Function's
        # backward calls the backend itself, and has no layer of its own to mark)
        dispatch._AUTOGRAD[op] = (setup, backward_timed)
        for _ in range(30):
            call()
        torch.cuda.synchronize()
        gaps = collections.defaultdict(list)
        total = []
        for _ in range(calls):
            marks.clear()
            call()
            total.append((marks[-1][1] - marks[0][1]) * 1e3)
            for (a, ta), (b, tb) in zip(marks, marks[1:]):
                gaps[f"{a} -> {b}"].append((tb - ta) * 1e6)
        torch.cuda.synchronize()
    finally:
        for owner, name, fn in restore:
            setattr(owner, name, fn)
        launch.FastLaunch._launch = saved_launch
        dispatch._AUTOGRAD[op] = (setup, backward)
    print(f"=== timeline of linear_logprob_entropy at {shape}, back to back: {statistics.median(total):.3f} ms "
          f"a call (median of {calls}); us between marks (median, least)")
    for k, v in gaps.items():
        print(f"  {k:50s} {statistics.median(v):8.1f} {min(v):8.1f}")

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, heavy):
            ctx.heavy = heavy
            ctx.save_for_backward(x, w)
            n = x.shape[0]
            return x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)

        @staticmethod
        def backward(ctx, g1, g2):
            x, w = ctx.saved_tensors
            if not ctx.heavy:
                return torch.empty_like(x), torch.empty_like(w), None
            dz = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
            dw = torch.empty_like(w)
            torch.mm(dz.t(), x, out=dw)
            return torch.empty_like(x), dw, None

    for heavy in (False, True):
        def floor(heavy=heavy):
            x.grad = w.grad = None
            a, b = Bare.apply(x, w, heavy)
            (a.sum() + b.sum()).backward()

        for _ in range(30):
            floor()
        ms = min(_host_ms(floor, calls) for _ in range(5))
        what = "with the backward's allocations and dW product" if heavy else "empty outputs and gradients"
        print(f"  a bare autograd Function, {what}: {ms:.3f} ms a call")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--shape", type=int, nargs=3, default=None)
    ap.add_argument("--paths", nargs="+", default=None)
    ap.add_argument("--dx-tiles", action="store_true")
    ap.add_argument("--dw-routes", action="store_true")
    ap.add_argument("--host-parts", action="store_true",
                    help="where a small log-prob call's host time goes (launches taken apart)")
    ap.add_argument("--launches", action="store_true",
                    help="direct launches against Triton's own: launch parts, host time a call")
    ap.add_argument("--tma-threshold", action="store_true",
                    help="two descriptor thresholds (2^34, 2^37) interleaved: wall and host a call")
    ap.add_argument("--descriptors", action="store_true",
                    help="small products by pointers (this tree's rule) against descriptors")
    ap.add_argument("--dz-group", type=int, default=None,
                    help="row blocks of the logit-gradient kernel's program groups (a trial value)")
    ap.add_argument("--timeline", action="store_true",
                    help="a small log-prob call's host time stage by stage (timestamps)")
    args = ap.parse_args()
    if args.timeline:
        timeline(args.shape or (256, 896, 32000))
    if args.dz_group:
        from mcore_hooks.kernels.triton_backend import triton_fused

        triton_fused._DZ_GROUP = args.dz_group
    if args.dw_routes:
        dw_routes(args.shape or (1024, 4096, 151936))
    if args.dx_tiles:
        dx_tiles(args.shape or (16384, 4096, 151936))
    if args.host_parts:
        launch_floor()
        launch_parts()
        host_parts(args.shape or (256, 896, 32000))
    if args.descriptors:
        descriptors([tuple(args.shape)] if args.shape else
                    [(256, 896, 32000), (512, 896, 32000), (256, 1536, 32000), (256, 896, 151936)],
                    args.paths or ["lp", "policy"])
    if args.tma_threshold:
        descriptors([tuple(args.shape)] if args.shape else TMA_SHAPES,
                    args.paths or ["lp", "policy", "policy_main_grad", "ce"], (1 << 34, 1 << 37))
    if args.launches:
        launches(args.shape or (256, 896, 32000), args.paths or ["stock_lp", "lp", "ce", "stock_policy", "policy", "policy_main_grad"])
    if args.host:
        launch_floor()
        host(args.shape or (256, 896, 32000),
             args.paths or ["stock_lp", "lp", "ce", "policy", "policy_main_grad", "policy_main_grad_declared"])
    if args.kernels:
        kernels(args.shape or (16384, 4096, 151936), args.paths or ["lp", "policy", "liger_ce", "stock_lp"])


if __name__ == "__main__":
    main()
