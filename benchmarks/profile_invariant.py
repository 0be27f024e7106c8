"""Where batch invariance's cost goes (``batch_invariant=True``: a mode, then the default), and
which parts of the Triton path vary with the batch (one GPU; issue 32).

    python benchmarks/profile_invariant.py [--hidden 4096] [--vocab 151936] [--out DIR]

1. Time: ``batch_invariant=False`` and ``True`` (the default from issue 32 on; before, the
   invariant mode), forward and forward+backward, through ``linear_logprob_entropy`` (Triton), at
   1k-64k tokens (median of CUDA-event timed runs).
2. Kernels: a torch.profiler summary of one forward+backward of each mode at 1k and 16k tokens
   (CUDA time by kernel name), to see whether the mode's cost is padding, relaunches, the
   statistics kernel's grid or cuBLAS.
3. Variance sources of the default path: tokens 0-127 in calls of 1 to 65536 tokens, and tokens
   5-6 called alone against the same tokens in those calls: the forward statistics (log-prob,
   entropy) and dX rows; and cuBLAS alone: the rows of ``dz[M, Vc] @ W[Vc, H]`` (the backward's
   dX product) for M = 1 to 16384, bitwise against M = 128.

4. The fused losses (``fused``): tokens 0-127's log-probs and dX rows from ``linear_policy_loss``
   and ``linear_cross_entropy`` in calls of 1 to 16384 tokens against a call of 128; and cuBLAS
   alone at their shapes: the rows of the logits ``x[M, H] @ W.T`` and of dX over the whole
   vocabulary ``dz[M, V] @ W`` into float32, for M = 1 to 8192, bitwise against M = 128.
5. ``policytime``: the fused policy loss (GRPO, dW formed), ``batch_invariant=False`` and
   ``True``, forward+backward.

``--sections time,kernels,variance`` picks parts; ``--tag`` names the JSON file apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton.testing

from mcore_hooks.kernels import linear_cross_entropy, linear_logprob_entropy, linear_policy_loss
from mcore_hooks.kernels.common.matmul import addmm_f32_, mm_f32


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
    ap.add_argument("--sections", default="time,kernels,variance",
                    help="comma-separated: time, kernels, variance")
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    h, v = args.hidden, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    nmax = max(args.tokens)
    x = torch.randn(nmax, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16()
    y = torch.randint(0, v, (nmax,), device="cuda", generator=g)
    rows = []
    print("| tokens | fwd batch_invariant=False / True ms | fwd+bwd False / True ms |\n|---|---|---|")
    for n in (args.tokens if "time" in sections else ()):
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
    for n in ((1024, 16384) if "kernels" in sections else ()):
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

    if "variance" in sections:
        variance(x, w, y, h, g, rows)
    if "fused" in sections:
        fused_variance(x, w, y, g, rows)
    if "policytime" in sections:
        policy_time(x, w, y, args.tokens, rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_invariant{args.tag}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), hidden=h, vocab=v, rows=rows), f, indent=1)


def variance(x, w, y, h, g, rows) -> None:
    """Tokens 0-127 (and tokens 5-6 in a call starting at token 5) against the same tokens in
    calls of other sizes: log-prob, entropy and dX rows of the default path, bitwise."""
    print("\nVariance of the default path (tokens 0-127 against a call of 128; tokens 5-6 alone):")
    probe = 128

    def call(lo, hi):
        xg = x[lo:hi].clone().requires_grad_()
        r = linear_logprob_entropy(xg, w, y[lo:hi], backend="triton")
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        return r.logprob.detach(), r.entropy.detach(), xg.grad

    base = call(0, probe)
    pair = call(5, 7)
    for n in (1, 7, 129, 1000, 1024, 3000, 4096, 16384, 65536):
        got = call(0, n)
        k = min(n, probe)
        same = [bool(torch.equal(a[:k], b[:k])) for a, b in zip(base, got)]
        diff = [float((a[:k].double() - b[:k].double()).abs().max()) for a, b in zip(base, got)]
        if n >= 7:
            same.append(all(bool(torch.equal(a, b[5:7])) for a, b in zip(pair, got)))
        print(f"  {n} tokens: bitwise logprob/entropy/dX {same[:3]}, tokens 5-6 as alone "
              f"{same[3:]}, max diff {diff}")
        rows.append(dict(variance=n, bitwise=same, max_diff=diff))
        del got
        torch.cuda.empty_cache()

    print("\ncuBLAS dX rows (dz[M, Vc] @ W[Vc, H] into float32), first rows against M = 128:")
    vc = h
    dz = (torch.randn(16384, vc, device="cuda", generator=g) * 1e-3).bfloat16()
    wc = w[:vc]
    base = None
    for m in (128, 1, 2, 7, 64, 256, 1000, 1024, 2048, 4096, 16384):
        acc = torch.zeros(m, h, device="cuda")
        addmm_f32_(acc, dz[:m], wc)
        if base is None:
            base = acc.clone()
        k = min(m, probe)
        print(f"  M={m}: bitwise {bool(torch.equal(acc[:k], base[:k]))}, max diff "
              f"{float((acc[:k] - base[:k]).abs().max()):.3e}")
        rows.append(dict(cublas_m=m, bitwise=bool(torch.equal(acc[:k], base[:k]))))


def _policy(x, w, y, lo, hi, inv=False, ce=False):
    xg = x[lo:hi].clone().requires_grad_()
    n = hi - lo
    gen = torch.Generator(device="cuda").manual_seed(1)  # the same inputs for a token whatever n
    old = -torch.rand(x.shape[0], device="cuda", generator=gen)[lo:hi] * 3
    adv = torch.randn(x.shape[0], device="cuda", generator=gen)[lo:hi]
    tw = torch.full((n,), 1.0 / 4096, device="cuda")
    if ce:
        loss = linear_cross_entropy(xg, w, y[lo:hi], backend="triton", batch_invariant=inv)
        lp = None
    else:
        r = linear_policy_loss(xg, w, y[lo:hi], token_weight=tw, backend="triton",
                               inputs={"old_logprobs": old, "advantages": adv},
                               batch_invariant=inv)
        loss, lp = r.loss, r.logprob
    loss.backward()
    return lp, xg.grad


def fused_variance(x, w, y, g, rows) -> None:
    probe = 128
    for ce in (False, True):
        name = "linear_cross_entropy" if ce else "linear_policy_loss"
        print(f"\nVariance of {name}'s default path (tokens 0-127 against a call of 128):")
        base = _policy(x, w, y, 0, probe, ce=ce)
        pair = _policy(x, w, y, 5, 7, ce=ce)
        for n in (1, 7, 129, 1000, 1024, 2048, 3000, 4096, 16384):
            got = _policy(x, w, y, 0, n, ce=ce)
            k = min(n, probe)
            same = [a is None or bool(torch.equal(a[:k], b[:k])) for a, b in zip(base, got)]
            if n >= 7:
                same.append(all(a is None or bool(torch.equal(a, b[5:7])) for a, b in zip(pair, got)))
            print(f"  {n} tokens: bitwise logprob/dX {same[:2]}, tokens 5-6 as alone {same[2:]}")
            rows.append(dict(fused=name, tokens=n, bitwise=same))
            del got
            torch.cuda.empty_cache()
    v, h = w.shape
    for what in ("logits x[M, H] @ W.T", "dX dz[M, V] @ W"):
        print(f"\ncuBLAS {what} into float32, rows 0-127 against M = 128:")
        if what.startswith("dX"):
            a = (torch.randn(8192, v, device="cuda", generator=g) * 1e-3).bfloat16()
            b = w
        else:
            a, b = x[:8192], w.t()
        base = None
        for m in (128, 1, 2, 7, 64, 256, 1000, 1024, 2048, 3000, 4096, 8192):
            out = mm_f32(a[:m], b)
            if base is None:
                base = out.clone()
            k = min(m, probe)
            same = bool(torch.equal(out[:k], base[:k]))
            print(f"  M={m}: bitwise {same}, max diff {float((out[:k] - base[:k]).abs().max()):.3e}")
            rows.append(dict(cublas=what, m=m, bitwise=same))
            del out
        del a
        torch.cuda.empty_cache()


def policy_time(x, w, y, tokens, rows) -> None:
    print("\n| tokens | fused policy loss fwd+bwd batch_invariant=False / True ms |\n|---|---|")
    wg = w.detach().clone().requires_grad_()  # dW formed, as in training

    def step(n, inv):
        _policy(x, wg, y, 0, n, inv=inv)
        wg.grad = None

    for n in tokens:
        t = [median_ms(lambda: step(n, inv), reps=5) for inv in (False, True)]
        print(f"| {n} | {t[0]:.2f} / {t[1]:.2f} |")
        rows.append(dict(policy_tokens=n, default=t[0], invariant=t[1]))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
