"""The gathered dot products of given ids (``selected_ids``, kept sets): the Triton kernel's
launch variants against the dense product over the vocabulary, by K. GPU only.

    python benchmarks/profile_gather.py [--tokens 8192 --hidden 4096 --vocab 151936]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import triton
    import triton.testing

    from mcore_hooks.kernels.passes import candidates as cand
    from mcore_hooks.kernels.triton_backend import triton_fused as tf

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    n, h, v = a.tokens, a.hidden, a.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).bfloat16()
    coef = torch.ones(n, device="cuda")
    print(f"{torch.cuda.get_device_name()} N={n} H={h} V={v}")
    for k in (33, 64, 128, 256, 512):
        ids = torch.randint(0, v, (n, k), device="cuda", generator=g)
        out = torch.empty((n, k), dtype=torch.float32, device="cuda")
        ref = (x.float() @ w.float().t()).gather(1, ids) if k <= 64 else None
        line = [f"K={k:4d}", f"ideal {n * k * h * 2 / 3.35e12 * 1e3:6.2f}"]
        for bk, bh, warps in ((16, 256, 4), (32, 128, 4), (16, 512, 8), (8, 512, 4), (32, 256, 8)):
            def run():
                tf._gathered_dots_kernel[(n, triton.cdiv(k, bk))](
                    x, w, ids, out, k, h, x.stride(0), w.stride(0), BLOCK_K=bk, BLOCK_H=bh,
                    num_warps=warps)
            run()
            err = (out - ref).abs().max().item() if ref is not None else float("nan")
            ms = triton.testing.do_bench(run, warmup=20, rep=200)
            line.append(f"{bk}x{bh}/{warps}w {ms:6.2f} (err {err:.1e})")
        dense = triton.testing.do_bench(
            lambda: cand.candidate_logits(x, w, coef, ids, 0, 1 << 30), warmup=5, rep=100) \
            if not cand.gathers(k, v) else float("nan")
        line.append(f"dense {dense:6.2f}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
