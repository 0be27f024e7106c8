"""Rollout parity on one GPU: time, peak memory and accuracy (vs float64) of each path, against the
plain fused log-prob of the same tokens, the stock unfused path (full logits, then the mask) and,
where importable, Liger 0.8.5's scaled cross-entropy with ``selected_token_ids``; then the batch
variance of the plain path and ``batch_invariant=True``'s cost (the default since issue 32).

    python benchmarks/bench_rollout.py [--tokens 8192] [--hidden 4096] [--vocab 151936] [--quick]

Prints a JSON line per measurement and Markdown tables (median ms of ``triton.testing.do_bench``;
peak memory beyond the inputs, MiB; max |log-prob - float64| over 256 sampled tokens).
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _data(n, h, v, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 * 3).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    # kept sets as a sampler makes them: the top-k of the (float32) logits, the label among them
    kept = torch.empty((n, k), dtype=torch.long, device="cuda")
    for s in range(0, n, 1024):
        kept[s:s + 1024] = (x[s:s + 1024] @ w.t()).float().topk(k, 1).indices
    y = kept[torch.arange(n, device="cuda"), torch.randint(0, k, (n,), device="cuda", generator=g)]
    teacher = torch.randint(0, v, (n, 32), device="cuda", generator=g)
    return x, w, y, kept, teacher


def _exact(x, w, y, rows, kept=None, ids=None, t=1.0):
    """float64 log-probs of the labels (renormalised over ``kept``), or of ``ids``, at ``rows``."""
    logits = (x[rows].double() @ w.double().t()) / t
    if kept is not None:
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, kept[rows], True)
        logits = logits.masked_fill(~mask, -math.inf)
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, ids[rows]) if ids is not None else logp.gather(1, y[rows, None]).squeeze(1)


def main() -> int:
    import triton.testing

    from mcore_hooks.kernels import Truncation, linear_logprob_entropy

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ours-only", action="store_true",
                    help="this library's paths alone: no stock, Liger or batch-invariance runs")
    args = ap.parse_args()
    n, h, v = args.tokens, args.hidden, args.vocab
    rep = 200 if args.quick else 600
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} N={n} H={h} V={v}")
    rows = torch.arange(0, n, max(1, n // 256), device="cuda")[:256]
    results = []

    def record(name, fn_fwd, fn_bwd, acc):
        fwd = triton.testing.do_bench(fn_fwd, warmup=50, rep=rep)
        both = triton.testing.do_bench(fn_bwd, warmup=50, rep=rep)
        mem = _peak(fn_bwd)
        r = dict(path=name, fwd_ms=fwd, fwd_bwd_ms=both, peak_mib=mem, max_abs_err=acc)
        results.append(r)
        print(json.dumps(r), flush=True)

    for k in (64, 512):
        x, w, y, kept, teacher = _data(n, h, v, k)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

        def ours(opts):
            def fwd():
                with torch.no_grad():
                    linear_logprob_entropy(x, w, y, **opts)

            def bwd():
                r = linear_logprob_entropy(xg, wg, y, **opts)
                out = r.selected.sum() if r.selected is not None else r.logprob.sum() + r.entropy.sum()
                out.backward()
                xg.grad = wg.grad = None

            with torch.no_grad():
                r = linear_logprob_entropy(x, w, y, **opts)
            return fwd, bwd, r

        def stock(mask_k):
            """Full bf16 logits (Megatron's output layer), float32, the mask, log_softmax."""
            def run(grad):
                with torch.set_grad_enabled(grad):
                    logits = (xg if grad else x) @ (wg if grad else w).t()
                    z = logits.float()
                    if mask_k is not None:
                        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, mask_k, True)
                        z = z.masked_fill(~keep, -math.inf)
                    logp = torch.log_softmax(z, -1)
                    lp = logp.gather(1, y[:, None]).squeeze(1)
                    if grad:
                        lp.sum().backward()
                        xg.grad = wg.grad = None
                    return lp
            return (lambda: run(False)), (lambda: run(True)), run(False)

        if k == 64:
            fwd, bwd, r = ours({})
            record("plain fused log-prob + entropy", fwd, bwd,
                   (r.logprob[rows].double() - _exact(x, w, y, rows)).abs().max().item())
            if not args.ours_only:
                fwd, bwd, lp = stock(None)
                record("stock: full logits, log_softmax", fwd, bwd,
                       (lp[rows].double() - _exact(x, w, y, rows)).abs().max().item())
            fwd, bwd, r = ours(dict(selected_ids=teacher))
            record("selected ids (K=32) + label, full distribution", fwd, bwd,
                   (r.selected[rows].double() - _exact(x, w, y, rows, ids=teacher)).abs().max().item())
            fwd, bwd, r = ours(dict(truncation=Truncation(top_k=64, top_p=0.95)))
            record("recomputed truncation (top-k 64, top-p 0.95)", fwd, bwd, float("nan"))
            # per request: 64 requests of n / 64 tokens each, their own options (the largest
            # top-k, 64, sizes the kept set as the scalar form's does)
            per = -(-n // 64)
            g = torch.Generator().manual_seed(1)
            req_k = torch.randint(16, 65, (64,), generator=g)
            req_k[0] = 64
            spread = torch.arange(n) // per
            t_req = Truncation(top_k=req_k[spread], top_p=(0.8 + 0.2 * torch.rand(64, generator=g))[spread].cuda(),
                               min_p=torch.where(torch.rand(64, generator=g) > 0.5, 0.02, 0.0)[spread].cuda())
            fwd, bwd, r = ours(dict(truncation=t_req))
            record("recomputed truncation, per request (vLLM rule)", fwd, bwd, float("nan"))
            fwd, bwd, r = ours(dict(truncation=Truncation(top_k=req_k[spread], top_p=t_req.top_p,
                                                          min_p=t_req.min_p, engine="sglang")))
            record("recomputed truncation, per request (SGLang rule)", fwd, bwd, float("nan"))
        fwd, bwd, r = ours(dict(kept_ids=kept))
        record(f"kept-set replay (K={k})", fwd, bwd,
               (r.logprob[rows].double() - _exact(x, w, y, rows, kept=kept)).abs().max().item())
        if args.ours_only:
            continue
        fwd, bwd, lp = stock(kept)
        record(f"stock: full logits, mask (K={k}), log_softmax", fwd, bwd,
               (lp[rows].double() - _exact(x, w, y, rows, kept=kept)).abs().max().item())
        if k == 64:
            _liger(x, w, y, teacher, xg, wg, rows, record)
        torch.cuda.empty_cache()

    print("\n| path | fwd ms | fwd+bwd ms | peak MiB | max abs err vs float64 |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['path']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['peak_mib']:.0f} | {r['max_abs_err']:.2e} |")
    if not args.ours_only:
        _invariance(h, v, rep)
    return 0


def _liger(x, w, y, teacher, xg, wg, rows, record):
    """Liger 0.8.5's ``LigerFusedLinearScaledCrossEntropyFunction`` with ``selected_token_ids``:
    one ``[K]`` id set shared by every token (Liger's form), here the first token's teacher ids;
    SM90 CuTe-DSL kernel where ``nvidia-cutlass-dsl`` imports, else its chunked fallback."""
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction, _resolve_implementation)
    except ImportError as e:
        print(json.dumps({"path": "liger", "skipped": str(e)}))
        return
    sel = teacher[0].contiguous()
    try:
        impl = _resolve_implementation(x.device).__name__
        with torch.no_grad():
            out = LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, y, 1.0, -100, 1, True, sel)
    except Exception as e:  # a benchmark: say why Liger's kernel did not run, and go on
        print(json.dumps({"path": "liger", "skipped": f"{type(e).__name__}: {e}"[:300]}))
        return

    def fwd():
        with torch.no_grad():
            LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, y, 1.0, -100, 1, True, sel)

    def bwd():
        out = LigerFusedLinearScaledCrossEntropyFunction.apply(xg, wg, y, 1.0, -100, 1, True, sel)
        out[-1].sum().backward()
        xg.grad = wg.grad = None

    ids = sel.expand(x.shape[0], -1)
    err = (out[-1][rows].double() - _exact(x, w, y, rows, ids=ids)).abs().max().item()
    record(f"Liger 0.8.5 selected_token_ids (K=32, shared) [{impl}]", fwd, bwd, err)

    from mcore_hooks.kernels import linear_logprob_entropy

    def ours_fwd():
        with torch.no_grad():
            linear_logprob_entropy(x, w, y, selected_ids=ids)

    def ours_bwd():
        linear_logprob_entropy(xg, wg, y, selected_ids=ids).selected.sum().backward()
        xg.grad = wg.grad = None

    with torch.no_grad():
        r = linear_logprob_entropy(x, w, y, selected_ids=ids)
    record("ours, the same shared ids (K=32)", ours_fwd, ours_bwd,
           (r.selected[rows].double() - _exact(x, w, y, rows, ids=ids)).abs().max().item())


def _invariance(h, v, rep):
    """The plain path's batch variance (the same 7 tokens' log-probs in calls of 7 to 16384
    tokens) and ``batch_invariant=True``'s cost, both backends."""
    import triton.testing

    from mcore_hooks.kernels import linear_logprob_entropy

    g = torch.Generator(device="cuda").manual_seed(1)
    big = 16384
    x = torch.randn(big, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 * 3).bfloat16()
    y = torch.randint(0, v, (big,), device="cuda", generator=g)
    print("\n| backend | mode | max change of a token's log-prob / entropy, 7..16384 tokens |\n|---|---|---|")
    for backend in ("torch", "triton"):
        for inv in (False, True):
            base = None
            worst = [0.0, 0.0]
            for n in (7, 128, 1000, 4096, 16384):
                with torch.no_grad():
                    r = linear_logprob_entropy(x[:n], w, y[:n], backend=backend, batch_invariant=inv)
                got = (r.logprob[:7], r.entropy[:7])
                if base is None:
                    base = got
                worst = [max(worst[i], (got[i] - base[i]).abs().max().item()) for i in range(2)]
            print(f"| {backend} | {'batch-invariant' if inv else 'plain'} | {worst[0]:.2e} / {worst[1]:.2e} |")
            print(json.dumps(dict(backend=backend, invariant=inv, logprob_change=worst[0], entropy_change=worst[1])))
    print("\n| backend | tokens | plain fwd+bwd ms | batch-invariant fwd+bwd ms | cost |\n|---|---|---|---|---|")
    for backend in ("torch", "triton"):
        for n in (512, 4096, 16384):
            xg, wg = x[:n].clone().requires_grad_(), w.clone().requires_grad_()
            times = []
            for inv in (False, True):
                def step():
                    r = linear_logprob_entropy(xg, wg, y[:n], backend=backend, batch_invariant=inv)
                    (r.logprob.sum() + r.entropy.sum()).backward()
                    xg.grad = wg.grad = None
                times.append(triton.testing.do_bench(step, warmup=20, rep=rep))
            print(f"| {backend} | {n} | {times[0]:.2f} | {times[1]:.2f} | {100 * (times[1] / times[0] - 1):+.1f}% |")
            print(json.dumps(dict(backend=backend, tokens=n, plain_ms=times[0], invariant_ms=times[1])))


if __name__ == "__main__":
    raise SystemExit(main())
