"""Where the Triton backend's time goes, and which tile shapes are fastest (one GPU).

    python benchmarks/profile_kernels.py [--shape 16384 4096 151936]

Times the forward stats kernel for several tile configurations, and the backward's parts (the
logit-gradient kernel, cuBLAS dW, the fp32 dX accumulation) separately, against the matmul floor.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.testing

from mcore_hooks.kernels.triton_backend import triton_fused as tf
from mcore_hooks.kernels.triton_backend import triton_tiles as tt


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def backend(bn: int, bv: int, bk: int, nw: int, ns: int, tma: bool = True) -> tf.TritonFused:
    """The Triton backend with these tiles for the statistics and logit-gradient kernels (a
    sweep's candidate); the fused losses' hidden gradient keeps sm_90's tile."""
    tile = tt.Tile(bn, bv, bk, nw, ns)
    return tf.TritonFused(tt.Tiles(f"{bn}x{bv}x{bk}/{nw}w/{ns}s", (0, 0), fwd=tile, bwd=tile,
                                   dx=tt.TILES[0].dx, tma=tma))


DEFAULT = tf.TritonFused(tt.TILES[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[16384, 4096, 151936])
    ap.add_argument("--tma", action="store_true", help="only compare TMA and pointer tile loads")
    ap.add_argument("--ce", action="store_true", help="only the reduced cross-entropy (6NHV) path")
    ap.add_argument("--ce-chunks", type=int, nargs="+", default=None,
                    help="only linear_cross_entropy fwd+bwd at these chunk sizes (A B .. B A)")
    ap.add_argument("--splits", action="store_true",
                    help="only the forward grid's vocab splits against the rule they replaced")
    ap.add_argument("--segments", type=int, nargs="+", default=None,
                    help="only the statistics pass with these vocabulary segment counts, at full "
                         "vocabularies, their TP shards and few tokens")
    args = ap.parse_args()
    if args.splits:
        compare_splits([(16384, 4096, 151936), (32768, 8192, 128256)])
        return
    if args.segments:
        compare_segments(SEGMENT_SHAPES, args.segments)
        return
    n, h, v = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    label = torch.randint(0, v, (n,), device="cuda", generator=g)
    coef = torch.ones(n, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling = 2 * 8192**3 / bench(lambda: a @ a) / 1e9
    flop = 2 * n * h * v
    print(f"shape {n}x{h}x{v}; bf16 matmul ceiling {ceiling:.0f} TF/s; 2NHV floor {flop / ceiling / 1e9:.1f} ms")
    print(f"cuBLAS logits x @ w.T (bf16 out): {bench(lambda: x @ w.t()):.1f} ms")

    if args.tma:
        compare_tma(x, w, coef, label, flop, ceiling)
        return
    if args.ce_chunks:
        compare_ce_chunks(x, w, label, args.ce_chunks, flop, ceiling)
        return
    if args.ce:
        profile_ce(x, w, label, flop, ceiling)
        return
    print("\nforward stats kernel: BLOCK_N BLOCK_V BLOCK_K warps stages min_splits -> ms, % of ceiling")
    base_splits = tf._MIN_SPLITS
    best = None
    for bn, bv, bk, nw, ns in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4),
                               (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
                               (64, 256, 64, 4, 4)]:
        for ms_ in (8, 16, 32):
            candidate = backend(bn, bv, bk, nw, ns)
            tf._MIN_SPLITS = ms_
            try:
                t = bench(lambda: candidate.local_stats(x, w, coef, label, 0))
            except Exception as e:  # noqa: BLE001 - out of resources etc.
                print(f"  {bn} {bv} {bk} {nw} {ns} {ms_}: {type(e).__name__}")
                break
            print(f"  {bn} {bv} {bk} {nw} {ns} {ms_}: {t:.1f} ms, {flop / t / 1e9 / ceiling:.0%}", flush=True)
            if best is None or t < best[0]:
                best = (t, candidate.tiles.name, ms_)
    print(f"best forward: {best}")
    tf._MIN_SPLITS = base_splits

    stats = DEFAULT.local_stats(x, w, coef, label, 0)
    m, log_s = stats.max, torch.log(stats.sumexp)
    ent = torch.rand(n, device="cuda")
    g1 = torch.randn(n, device="cuda")
    g2 = torch.randn(n, device="cuda")
    print("\nbackward parts, per chunk width Vc (whole vocabulary):")
    for vc in (1024, 2048, 4096):
        dz = torch.empty((n, vc), dtype=x.dtype, device="cuda")
        dx = torch.zeros((n, h), dtype=torch.float32, device="cuda")
        dw = torch.empty_like(w)
        for bn, bv, bk, nw, ns in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]:
            cfg = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=ns)

            def dlogits():
                for v0 in range(0, v, vc):
                    width = min(vc, v - v0)
                    tf._dlogits_kernel[(triton.cdiv(width, bv) * triton.cdiv(n, bn),)](
                        x, w, coef, label, m, log_s, ent, g1, g2, dz, n, v, h, v0, width,
                        x.stride(0), w.stride(0), dz.stride(0), EVEN_K=h % bk == 0, USE_TMA=False,
                        GROUP=tf._DZ_GROUP, **cfg)

            t = bench(dlogits)
            print(f"  Vc={vc} dlogits {bn} {bv} {bk} {nw} {ns}: {t:.1f} ms ({flop / t / 1e9 / ceiling:.0%})", flush=True)

        def dw_part():
            for v0 in range(0, v, vc):
                width = min(vc, v - v0)
                torch.mm(dz[:, :width].t(), x, out=dw[v0 : v0 + width])

        def dx_addmm():
            for v0 in range(0, v, vc):
                width = min(vc, v - v0)
                torch.addmm(dx, dz[:, :width], w[v0 : v0 + width], out_dtype=torch.float32, out=dx)

        def dx_mm_add():
            for v0 in range(0, v, vc):
                width = min(vc, v - v0)
                dx.add_(torch.mm(dz[:, :width], w[v0 : v0 + width], out_dtype=torch.float32))

        def dx_bf16():
            dxb = torch.zeros((n, h), dtype=x.dtype, device="cuda")
            for v0 in range(0, v, vc):
                width = min(vc, v - v0)
                dxb.addmm_(dz[:, :width], w[v0 : v0 + width])

        for name, fn in (("dW mm", dw_part), ("dX addmm out_dtype", dx_addmm), ("dX mm out_dtype + add", dx_mm_add),
                         ("dX bf16 addmm_ (rounds per chunk)", dx_bf16)):
            try:
                t = bench(fn)
                print(f"  Vc={vc} {name}: {t:.1f} ms ({flop / t / 1e9 / ceiling:.0%})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  Vc={vc} {name}: {type(e).__name__}: {str(e)[:100]}")


def compare_tma(x, w, coef, label, flop, ceiling) -> None:
    """Forward and logit-gradient kernels with tensor-descriptor (TMA) vs pointer tile loads."""
    n, h = x.shape
    v = w.shape[0]
    base_splits = tf._MIN_SPLITS
    ref = None
    print("\nforward: BLOCK_N BLOCK_V BLOCK_K warps stages splits tma -> ms, % of ceiling")
    for bn, bv, bk, nw, ns in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 256, 128, 8, 2)]:
        for splits in (4, 8):
            for tma in (False, True):
                candidate = backend(bn, bv, bk, nw, ns, tma)
                tf._MIN_SPLITS = splits
                try:
                    st = candidate.local_stats(x, w, coef, label, 0)
                    t = bench(lambda: candidate.local_stats(x, w, coef, label, 0))
                except Exception as e:  # noqa: BLE001
                    print(f"  {bn} {bv} {bk} {nw} {ns} {splits} {tma}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                lse = st.max + torch.log(st.sumexp)
                ref = lse if ref is None else ref
                print(f"  {bn} {bv} {bk} {nw} {ns} {splits} {tma}: {t:.1f} ms, {flop / t / 1e9 / ceiling:.0%}"
                      f" (max |lse diff| {(lse - ref).abs().max().item():.1e})", flush=True)
    tf._MIN_SPLITS = base_splits
    stats = DEFAULT.local_stats(x, w, coef, label, 0)
    m, log_s = stats.max, torch.log(stats.sumexp)
    ent = torch.rand(n, device="cuda")
    g1, g2 = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    vc = 4096
    dz = torch.empty((n, vc), dtype=x.dtype, device="cuda")
    print("\nlogit-gradient kernel over the vocabulary, Vc=4096: config tma -> ms")
    for bn, bv, bk, nw, ns in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4)]:
        cfg = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=ns)
        for tma in (False, True):
            xa, wa, used = tf._operands(x, w, tt.Tile(bn, bv, bk, nw, ns), tma)

            def dlogits():
                for v0 in range(0, v, vc):
                    width = min(vc, v - v0)
                    tf._dlogits_kernel[(triton.cdiv(width, bv) * triton.cdiv(n, bn),)](
                        xa, wa, coef, label, m, log_s, ent, g1, g2, dz, n, v, h, v0, width,
                        x.stride(0), w.stride(0), dz.stride(0), EVEN_K=h % bk == 0, USE_TMA=used,
                        GROUP=tf._DZ_GROUP, **cfg)

            try:
                t = bench(dlogits)
                print(f"  {bn} {bv} {bk} {nw} {ns} {used}: {t:.1f} ms ({flop / t / 1e9 / ceiling:.0%})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {bn} {bv} {bk} {nw} {ns} {tma}: {type(e).__name__}: {str(e)[:80]}")


def profile_ce(x, w, label, flop, ceiling) -> None:
    """linear_cross_entropy fwd+bwd per chunk budget, and its parts per chunk (x chunk count)."""
    from mcore_hooks.kernels import linear_cross_entropy
    from mcore_hooks.kernels.passes.arguments import _fused_chunk_size

    n, h = x.shape
    v = w.shape[0]
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def run():
        xr.grad = wr.grad = None
        linear_cross_entropy(xr, wr, label, backend="triton").backward()

    print("\nreduced cross-entropy fwd+bwd (6NHV floor "
          f"{3 * flop / ceiling / 1e9:.1f} ms): budget -> tokens/chunk, ms, % of ceiling, peak extra MiB")
    base = tf.TritonFused.fused_chunk_bytes
    for budget in (1 << 30, 3 << 29, 1 << 31, 5 << 29, 3 << 30, 1 << 32, 5 << 30):
        tf.TritonFused.fused_chunk_bytes = budget
        c = _fused_chunk_size(tf.TritonFused(), n, v, x.element_size())
        t, peak = _time_and_peak(run, lambda: setattr(xr, "grad", None) or setattr(wr, "grad", None))
        print(f"  {budget >> 20} MiB -> {c}: {t:.1f} ms, {3 * flop / t / 1e9 / ceiling:.0%}, {peak:.0f} MiB",
              flush=True)
    tf.TritonFused.fused_chunk_bytes = base
    xr.grad = wr.grad = None
    for c in (2048, 4096):
        _ce_parts(x, w, label, c, flop, ceiling)
        torch.cuda.empty_cache()


def compare_ce_chunks(x, w, label, chunks, flop, ceiling) -> None:
    """linear_cross_entropy fwd+bwd at the given chunk sizes, in order and then reversed (the
    fastest of the two shown, both in brackets)."""
    from mcore_hooks.kernels import linear_cross_entropy

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    times: dict = {}
    for c in list(chunks) + list(reversed(chunks)):
        def run():
            xr.grad = wr.grad = None
            linear_cross_entropy(xr, wr, label, backend="triton", chunk_size=c).backward()

        times.setdefault(c, []).append(bench(run))
    print("\nlinear-CE fwd+bwd by chunk size:")
    for c, ts in times.items():
        t = min(ts)
        print(f"  {c} tokens: {t:.1f} ms ({' / '.join(f'{v:.1f}' for v in ts)}), "
              f"{3 * flop / t / 1e9 / ceiling:.0%} of 6NHV", flush=True)


def _time_and_peak(run, clear) -> tuple[float, float]:
    """Median ms of ``run`` and its peak memory allocated beyond what was live before (MiB)."""
    run()
    clear()
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - m0) / 2**20
    clear()
    return bench(run), peak


def _ce_parts(x, w, label, c, flop, ceiling) -> None:
    """Each pass of one chunk of ``c`` tokens (logits in half chunks), times the number of chunks."""
    from mcore_hooks.kernels.common.matmul import addmm_f32_, mm_f32

    n, h = x.shape
    v = w.shape[0]
    k = -(-n // c)
    cz = c // 2
    z = torch.empty((cz, v), dtype=torch.float32, device="cuda")
    dz = (torch.randn((c, v), device="cuda") * 1e-3).to(x.dtype)  # never time products on zeros
    coef = torch.ones(cz, device="cuda")
    ll = label[:cz]
    m, log_s = torch.full((cz,), 10.0, device="cuda"), torch.full((cz,), 2.0, device="cuda")
    dzr = torch.empty((cz, v), dtype=x.dtype, device="cuda")  # row grad's output, apart from dz
    dx32 = torch.empty((c, h), dtype=torch.float32, device="cuda")
    dw32 = torch.zeros((v, h), dtype=torch.float32, device="cuda")
    dwb = torch.zeros((v, h), dtype=x.dtype, device="cuda")
    parts = {
        "logits mm (fp32 out)": lambda: mm_f32(x[:cz], w.t(), out=z),
        "row stats": lambda: DEFAULT.row_stats(z, coef, ll, False),
        "row grad": lambda: DEFAULT.row_grad(z, coef, ll, m, log_s, coef, None, None, dzr),
        "dX mm (fp32 out)": lambda: mm_f32(dz, w, out=dx32),
        "dW addmm (fp32 acc)": lambda: addmm_f32_(dw32, dz.t(), x[:c]),
        "dW addmm_ (bf16 acc, rounds per chunk)": lambda: dwb.addmm_(dz.t(), x[:c]),
    }
    for name, fn in parts.items():
        t = bench(fn) * k * (2 if ("logits" in name or name.startswith("row")) else 1)
        share = f", {flop / t / 1e9 / ceiling:.0%}" if "mm" in name else ""
        print(f"  chunk {c} x {k}: {name}: {t:.1f} ms{share}", flush=True)


def compare_splits(shapes) -> None:
    """The forward grid's vocab splits, :func:`forward_splits` against the rule it replaced
    (the fewest splits giving two programs per SM), at RL micro-batch sizes and the full shape.
    Written for one launch over the whole call: since the kernel launches per ``_FWD_GROUP``
    tokens over vocabulary segments, the split counts it prints are the whole call's, not a
    launch's (the timings still run the kernel as it is)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ceiling = 2 * 8192**3 / bench(lambda: a @ a) / 1e9
    print(f"bf16 matmul ceiling {ceiling:.0f} TF/s")
    sms = tf._num_sms(0)
    rule = tf.forward_splits
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, h, v in shapes:
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
        label = torch.randint(0, v, (n,), device="cuda", generator=g)
        print(f"\n== hidden {h} x vocab {v}", flush=True)
        for rows in sorted({2048, 4096, n}):
            xs, ls, cs = x[:rows], label[:rows], torch.ones(rows, device="cuda")
            rb = triton.cdiv(rows, DEFAULT.tiles.fwd.block_n)
            old = max(tf._MIN_SPLITS, math.ceil(2 * sms / rb))
            flop = 2 * rows * h * v
            times: dict = {}
            a, b = ("old rule", lambda *_: old), ("forward_splits", rule)
            # A B B A: whichever runs first can be a few % slower (clocks settling)
            for name, pick in (a, b, b, a):
                tf.forward_splits = pick
                try:
                    sp = pick(rb, triton.cdiv(v, DEFAULT.tiles.fwd.block_v), sms)
                    times.setdefault((name, sp), []).append(bench(lambda: DEFAULT.local_stats(xs, w, cs, ls, 0)))
                finally:
                    tf.forward_splits = rule
            for (name, sp), ts in times.items():
                t = min(ts)
                print(f"  {rows} tokens, {name} ({sp} splits): {t:.2f} ms ({' / '.join(f'{x:.2f}' for x in ts)}), "
                      f"{flop / t / 1e9 / ceiling:.0%}", flush=True)


# Full vocabularies and their TP 2 / 4 / 8 shards at the benchmark's token count, and few-token calls.
SEGMENT_SHAPES = [(16384, 4096, v) for v in (151936, 75968, 37984, 18992, 128256, 64128, 32064, 32000)] + [
    (256, 4096, 151936), (256, 8192, 151936), (512, 4096, 151936), (2048, 4096, 151936), (256, 896, 32000)]


def compare_segments(shapes, counts, rounds: int = 3) -> None:
    """The statistics pass (the kernel and the segments' merge, ``local_stats``) with the
    vocabulary cut into each of ``counts`` segments (:data:`~.triton_fused._SEGMENTS`), the
    counts interleaved in ``rounds`` rounds; the least and each round's ms."""
    base = tf._SEGMENTS
    sms = tf._num_sms(0)
    tile = DEFAULT.tiles.fwd
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, h, v in shapes:
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
        label = torch.randint(0, v, (n,), device="cuda", generator=g)
        coef = torch.ones(n, device="cuda")
        times: dict = {c: [] for c in counts}
        try:
            for _ in range(rounds):
                for c in counts:
                    tf._SEGMENTS = c
                    times[c].append(bench(lambda: DEFAULT.local_stats(x, w, coef, label, 0)))
        finally:
            tf._SEGMENTS = base
        vtiles = triton.cdiv(v, tile.block_v)
        rb = min(triton.cdiv(n, tile.block_n), tf._FWD_GROUP // tile.block_n)
        parts = []
        for c in counts:
            tf._SEGMENTS = c
            seg_tiles, segs = tf.vocab_segments(vtiles)
            tf._SEGMENTS = base
            splits = tf.forward_splits(rb, segs, sms)
            parts.append(f"S{c} ({segs} x {seg_tiles} tiles, {splits} splits): {min(times[c]):.3f} "
                         f"({' / '.join(f'{t:.3f}' for t in times[c])})")
        print(f"{n}x{h}x{v}: " + "; ".join(parts), flush=True)
        del x, w


if __name__ == "__main__":
    main()
