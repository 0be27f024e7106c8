"""Where the batch-invariant mode's cost goes, and which parts of the default path vary with the
batch (one GPU; issue 32's measurements before the design).

    python benchmarks/profile_invariant.py [--hidden 4096] [--vocab 151936] [--out DIR]

1. Time: the default and the invariant mode, forward and forward+backward, through
   ``linear_logprob_entropy`` (Triton), at 1k-64k tokens (median of CUDA-event timed runs).
2. Kernels: a torch.profiler summary of one forward+backward of each mode at 1k and 16k tokens
   (CUDA time by kernel name), to see whether the mode's cost is padding, relaunches, the
   statistics kernel's grid or cuBLAS.
3. Variance sources of the default path: the first 128 tokens' results in calls of 128 to 16384
   tokens: the forward statistics (log-prob, entropy) and dX rows; and cuBLAS alone: the rows of
   ``dz[M, Vc] @ W[Vc, H]`` (the backward's dX product) for several M, bitwise against M = 128.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton.testing

from mcore_hooks.kernels import linear_logprob_entropy
from mcore_hooks.kernels.matmul import addmm_f32_


def median_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = ap.parse_args()
    h, v = args.hidden, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    nmax = max(args.tokens)
    x = torch.randn(nmax, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    y = torch.randint(0, v, (nmax,), device="cuda", generator=g)
    rows = []
    print("| tokens | fwd default / invariant ms | fwd+bwd default / invariant ms |\n|---|---|---|")
    for n in args.tokens:
        xs, ys = x[:n], y[:n]
        res = {}
        for inv in (False, True):
            def fwd():
                with torch.no_grad():
                    linear_logprob_entropy(xs, w, ys, backend="triton", batch_invariant=inv)

            xg, wg = xs.clone().requires_grad_(), w.clone().requires_grad_()

            def fwd_bwd():
                r = linear_logprob_entropy(xg, wg, ys, backend="triton", batch_invariant=inv)
                (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
                xg.grad = wg.grad = None

            res[inv] = (median_ms(fwd), median_ms(fwd_bwd, reps=5))
            del xg, wg
        rows.append(dict(tokens=n, default=res[False], invariant=res[True]))
        print(f"| {n} | {res[False][0]:.2f} / {res[True][0]:.2f} | {res[False][1]:.2f} / {res[True][1]:.2f} |")
        torch.cuda.empty_cache()

    print("\nKernels (CUDA ms, one forward+backward):")
    for n in (1024, 16384):
        for inv in (False, True):
            xg, wg = x[:n].clone().requires_grad_(), w.clone().requires_grad_()
            for _ in range(2):  # warm (compilation, autotuning)
                r = linear_logprob_entropy(xg, wg, y[:n], backend="triton", batch_invariant=inv)
                (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                r = linear_logprob_entropy(xg, wg, y[:n], backend="triton", batch_invariant=inv)
                (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
                torch.cuda.synchronize()
            table = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t:
                    table[e.key] = (t / 1000, e.count)
            top = sorted(table.items(), key=lambda kv: -kv[1][0])[:8]
            print(f"  {n} tokens, {'invariant' if inv else 'default'}: total "
                  f"{sum(t for t, _ in table.values()):.2f} ms")
            for k, (t, c) in top:
                print(f"    {t:8.2f} ms x{c:<4d} {k[:90]}")
            rows.append(dict(profile=n, invariant=inv, kernels={k: t for k, (t, _) in table.items()}))
            del xg, wg

    print("\nVariance of the default path (first 128 tokens against a call of 128):")
    probe = 128
    base = None
    for n in (128, 1024, 4096, 16384):
        xg = x[:n].clone().requires_grad_()
        r = linear_logprob_entropy(xg, w, y[:n], backend="triton")
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        got = (r.logprob[:probe].detach(), r.entropy[:probe].detach(), xg.grad[:probe])
        if base is None:
            base = got
        same = [bool(torch.equal(a, b)) for a, b in zip(base, got)]
        diff = [float((a.double() - b.double()).abs().max()) for a, b in zip(base, got)]
        print(f"  {n} tokens: bitwise logprob/entropy/dX {same}, max diff {diff}")
        rows.append(dict(variance=n, bitwise=same, max_diff=diff))

    print("\ncuBLAS dX rows (dz[M, Vc] @ W[Vc, H] into float32), first 128 rows against M = 128:")
    vc = h
    dz = (torch.randn(16384, vc, device="cuda", generator=g) * 1e-3).bfloat16()
    wc = w[:vc]
    base = None
    for m in (128, 256, 1024, 2048, 4096, 16384):
        acc = torch.zeros(m, h, device="cuda")
        addmm_f32_(acc, dz[:m], wc)
        if base is None:
            base = acc[:probe].clone()
        print(f"  M={m}: bitwise {bool(torch.equal(acc[:probe], base))}, max diff "
              f"{float((acc[:probe] - base).abs().max()):.3e}")
        rows.append(dict(cublas_m=m, bitwise=bool(torch.equal(acc[:probe], base))))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_invariant.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), hidden=h, vocab=v, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
