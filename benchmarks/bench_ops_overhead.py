"""The custom ops' cost: the same kernels timed through this checkout's entry points and through
another copy of the package (``--other``: a directory holding an ``mcore_hooks`` from before the
ops), in one process each, on one GPU:

    python benchmarks/bench_ops_overhead.py [--other DIR]

Prints median ms (Triton's ``do_bench``) of the log-prob pass and the fused policy loss, forward
and forward + backward, bf16, hidden 4096, vocab 151936, and of a small call (512 tokens, vocab
32000) where a fixed per-call cost would show.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

CASES = [(8192, 4096, 151936), (512, 4096, 32000)]


def _time() -> dict:
    import triton.testing

    from mcore_hooks.kernels import linear_logprob_entropy, linear_policy_loss

    out = {}
    for n, h, v in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device="cuda", generator=g) / 64).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        tw = torch.full((n,), 1.0 / n, device="cuda")
        inputs = {"old_logprobs": -torch.rand(n, device="cuda", generator=g), "advantages": torch.randn(n, device="cuda", generator=g)}

        def lp_fwd():
            with torch.no_grad():
                linear_logprob_entropy(x, w, y)

        def lp_bwd():
            r = linear_logprob_entropy(x, w, y)
            (r.logprob.sum() + r.entropy.sum()).backward()

        def pl_bwd():
            linear_policy_loss(x, w, y, token_weight=tw, inputs=inputs).loss.backward()

        for name, fn in (("logprob fwd", lp_fwd), ("logprob fwd+bwd", lp_bwd), ("policy fwd+bwd", pl_bwd)):
            out[f"{n}x{h}x{v} {name}"] = triton.testing.do_bench(fn, warmup=200, rep=800)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", default=None)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_time()))
        return 0
    runs = {}
    for label, path in (("this checkout", os.getcwd()), ("other", args.other)):
        if path is None:
            continue
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout + res.stderr, file=sys.stderr)
            return 1
        runs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| case | " + " | ".join(f"{k} ms" for k in runs) + " |\n|---|" + "---|" * len(runs))
    for case in next(iter(runs.values())):
        print(f"| {case} | " + " | ".join(f"{r[case]:.3f}" for r in runs.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
