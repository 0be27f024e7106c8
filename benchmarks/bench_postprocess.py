"""Post-process benchmark: the stock Megatron Core paths, mcore-hooks backends and Liger, side by side.

Run on one GPU (``--tp2`` also times the tensor-parallel case on two):

    python benchmarks/bench_postprocess.py --out results/ [--tp2] [--quick]

For each shape (tokens x hidden x vocab, bf16) and method it reports the median time (Triton's
``do_bench``, CUDA events) and the peak memory allocated beyond the inputs, forward-only (no
grad, as when computing old log-probs) and forward+backward (gradients to hidden states and output
weight); then the accuracy of log-prob and entropy against float64 on ordinary and hard logits.
Writes ``benchmarks/results/postprocess_<gpu>.json`` (date, device, versions, command) and its
plot beside it (``.png``); ``benchmarks/report.py`` renders them into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import traceback
from typing import Callable, Optional

import torch

SHAPES = [(16384, 4096, 151936), (32768, 8192, 128256), (16384, 4096, 129920), (16384, 4096, 248320)]


# --------------------------------------------------------------------------- methods
# Each method: (hidden [N, H], weight [V, H], labels [N]) -> a scalar to backward (or outputs).


def _megatron():
    from megatron.core import parallel_state, tensor_parallel

    return parallel_state, tensor_parallel


def stock_loss(x, w, y):
    _, tp = _megatron()
    logits = (x @ w.t()).view(-1, 1, w.shape[0])  # [s, b, V] bf16, as the output layer returns
    return tp.vocab_parallel_cross_entropy(logits, y.view(-1, 1)).sum()


def stock_loss_fused(x, w, y):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    ps, _ = _megatron()
    logits = (x @ w.t()).view(-1, 1, w.shape[0])
    return fused_vocab_parallel_cross_entropy(logits, y.view(-1, 1), ps.get_tensor_model_parallel_group()).sum()


def stock_rl(x, w, y):
    logits = (x @ w.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, y[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.sum() + ent.sum()


def hooks(backend: str):
    from mcore_hooks.kernels import linear_logprob_entropy

    def run(x, w, y):
        r = linear_logprob_entropy(x, w, y, backend=backend)
        return r.logprob.sum() + r.entropy.sum()

    return run


def hooks_ce(backend: str):
    from mcore_hooks.kernels import linear_cross_entropy

    def run(x, w, y):  # the processor's reduction="sum": gradients formed in the forward
        return linear_cross_entropy(x, w, y, backend=backend)

    return run


# GRPO step over the LM head: clipped ratio (clip-higher), token mean, optionally an entropy
# bonus. Old log-probs sit near the current ones (ratios across the clip bounds), advantages are
# one per sequence of GRPO_SEQ tokens.
GRPO_SEQ = 1024
GRPO_ENTROPY_COEF = 0.001
_grpo_cache: dict = {}


def grpo_inputs(x, w, y):
    key = (x.data_ptr(), w.data_ptr(), y.data_ptr())
    if key not in _grpo_cache:
        from mcore_hooks.kernels import linear_logprob_entropy

        _grpo_cache.clear()
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            lp = linear_logprob_entropy(x, w, y).logprob
        n = y.shape[0]
        old = lp + 0.3 * (torch.rand(n, device="cuda", generator=g) - 0.5)
        adv = torch.randn(n // GRPO_SEQ, device="cuda", generator=g).repeat_interleave(GRPO_SEQ)
        _grpo_cache[key] = (old, adv)
    return _grpo_cache[key]


def _grpo_cfg(entropy: bool):
    from mcore_hooks.kernels import PolicyLoss

    return PolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=GRPO_ENTROPY_COEF if entropy else 0.0)


def stock_grpo(entropy: bool):
    cfg = _grpo_cfg(entropy)

    def run(x, w, y):  # what RL frameworks do today: logits, fp32 log_softmax, the loss
        old, adv = grpo_inputs(x, w, y)
        logits = (x @ w.t()).float()
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, y[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1) if entropy else None
        return cfg(lp, ent, old_logprobs=old, advantages=adv).mean()

    return run


def hooks_grpo_two_pass(entropy: bool):
    from mcore_hooks.kernels import linear_logprob_entropy

    cfg = _grpo_cfg(entropy)

    def run(x, w, y):  # the log-prob/entropy pass, the loss in torch, logits recomputed
        old, adv = grpo_inputs(x, w, y)
        r = linear_logprob_entropy(x, w, y, backend="triton")
        return cfg(r.logprob, r.entropy, old_logprobs=old, advantages=adv).mean()

    return run


def hooks_grpo_fused(entropy: bool):
    from mcore_hooks.kernels import linear_policy_loss

    cfg = _grpo_cfg(entropy)

    def run(x, w, y):  # gradients formed in the forward
        old, adv = grpo_inputs(x, w, y)
        tw = torch.full_like(old, 1.0 / old.shape[0])
        return linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, backend="triton",
                                  inputs={"old_logprobs": old, "advantages": adv}).loss

    return run


_main_grad: dict = {}


def main_grad_of(w):
    """A float32 main_grad for ``w`` (made once, so it counts as existing memory, as Megatron's
    gradient buffer does)."""
    key = (w.data_ptr(), tuple(w.shape))
    if key not in _main_grad:
        _main_grad.clear()
        _main_grad[key] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    return _main_grad[key]


def hooks_grpo_main_grad(declared: bool = False, chunk_size: Optional[int] = None):
    from mcore_hooks.kernels import linear_policy_loss

    cfg = _grpo_cfg(False)

    # dW added into main_grad in the backward (8NHV), no [V, H] buffer; declared: the upstream
    # gradient (1, the benchmark's backward) given, dW added in the forward (6NHV)
    def run(x, w, y):
        old, adv = grpo_inputs(x, w, y)
        tw = torch.full_like(old, 1.0 / old.shape[0])
        return linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, backend="triton",
                                  inputs={"old_logprobs": old, "advantages": adv},
                                  weight_grad_accumulator=main_grad_of(w), chunk_size=chunk_size,
                                  upstream_grad=1.0 if declared else None).loss

    return run


def hooks_ce_main_grad(declared: bool = False):
    from mcore_hooks.kernels import linear_cross_entropy

    def run(x, w, y):
        return linear_cross_entropy(x, w, y, backend="triton", weight_grad_accumulator=main_grad_of(w),
                                    upstream_grad=1.0 if declared else None)

    return run


def liger_grpo():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=0.2,
                                    epsilon_high=0.28, loss_type="dapo")

    def run(x, w, y):
        old, adv = grpo_inputs(x, w, y)
        b = y.shape[0] // GRPO_SEQ
        out = loss(x.view(b, GRPO_SEQ, -1), w, y.view(b, GRPO_SEQ), torch.ones_like(y).view(b, GRPO_SEQ),
                   adv.view(b, GRPO_SEQ)[:, 0], old_per_token_logps=old.view(b, GRPO_SEQ))
        return out[0] if isinstance(out, tuple) else out

    return run


def liger():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda x, w, y: loss(w, x, y)


METHODS: list[tuple[str, str, Callable]] = [
    ("stock loss (bf16 logits -> fp32 CE)", "loss", lambda: stock_loss),
    ("stock loss, cross_entropy_loss_fusion", "loss", lambda: stock_loss_fused),
    ("stock RL: logits -> fp32 log_softmax -> logprob+entropy", "lp+ent", lambda: stock_rl),
    ("mcore-hooks torch, logprob+entropy", "lp+ent", lambda: hooks("torch")),
    ("mcore-hooks triton, logprob+entropy", "lp+ent", lambda: hooks("triton")),
    ("mcore-hooks triton, linear-CE (sum)", "loss", lambda: hooks_ce("triton")),
    ("Liger fused linear CE", "loss", liger),
    ("mcore-hooks triton, linear-CE (sum), dW into main_grad", "loss", hooks_ce_main_grad),
    ("mcore-hooks triton, linear-CE (sum), dW into main_grad in the forward (upstream_grad)", "loss",
     lambda: hooks_ce_main_grad(True)),
    ("stock GRPO: logits -> fp32 log_softmax -> clipped loss", "grpo", lambda: stock_grpo(False)),
    ("mcore-hooks two-pass GRPO (logprob, loss in torch)", "grpo", lambda: hooks_grpo_two_pass(False)),
    ("mcore-hooks fused GRPO (linear_policy_loss)", "grpo", lambda: hooks_grpo_fused(False)),
    ("mcore-hooks GRPO, dW into main_grad", "grpo", hooks_grpo_main_grad),
    ("mcore-hooks GRPO, dW into main_grad in the forward (upstream_grad)", "grpo",
     lambda: hooks_grpo_main_grad(True)),
    ("mcore-hooks GRPO, dW into main_grad in the forward, 2048-token chunks", "grpo",
     lambda: hooks_grpo_main_grad(True, 2048)),
    ("Liger fused linear GRPO", "grpo", liger_grpo),
    ("stock GRPO + entropy bonus", "grpo+ent", lambda: stock_grpo(True)),
    ("mcore-hooks two-pass GRPO + entropy bonus", "grpo+ent", lambda: hooks_grpo_two_pass(True)),
    ("mcore-hooks fused GRPO + entropy bonus", "grpo+ent", lambda: hooks_grpo_fused(True)),
]


# --------------------------------------------------------------------------- measuring


def measure(fn, x, w, y, backward: bool, rep_ms: int) -> tuple[float, float]:
    """Median ms and peak MiB allocated beyond what exists before the call."""
    import triton.testing

    def call():
        if backward:
            x.grad = None
            w.grad = None
            fn(x, w, y).backward()
        else:
            with torch.no_grad():
                fn(x, w, y)

    call()  # compile / warm
    x.grad = None
    w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # inputs only: the gradients count as extra
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(call, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")
    x.grad = None
    w.grad = None
    return ms, peak


def matmul_ceiling() -> float:
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / ms / 1e9  # TF/s


def accuracy(vocab_sizes, n=2048, h=4096) -> list[dict]:
    """Relative error vs float64 of log-prob and entropy from bf16 inputs, per method."""
    from mcore_hooks.kernels import linear_logprob_entropy

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for v in vocab_sizes:
        for case in ("ordinary", "offset +500", "offset -60"):
            x = torch.randn(n, h, device="cuda", generator=g)
            w = torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)
            if case != "ordinary":
                # one hidden unit is a constant 1 whose weight is the offset (exact in bf16):
                # logits = ordinary spread + offset, where bf16 logits lose the spread
                x[:, -1] = 1.0
                w[:, -1] = 500.0 if case == "offset +500" else -60.0
            x, w = x.bfloat16(), w.bfloat16()
            y = torch.randint(0, v, (n,), device="cuda", generator=g)
            logp = torch.log_softmax(x.double() @ w.double().t(), -1)
            lp_ref = logp.gather(1, y[:, None]).squeeze(1)
            ent_ref = -(logp.exp() * logp).sum(-1)
            del logp
            err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
            row = dict(vocab=v, case=case)
            with torch.no_grad():
                for name, backend in (("mcore-hooks triton", "triton"), ("mcore-hooks torch", "torch")):
                    r = linear_logprob_entropy(x, w, y, backend=backend)
                    row[f"{name} logprob"] = err(r.logprob, lp_ref)
                    row[f"{name} entropy"] = err(r.entropy, ent_ref)
            # the fused policy loss forms its statistics from fp32 logits chunks (cuBLAS), not the
            # forward kernel: its log-probs and entropies, with gradients formed, against float64
            from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

            xg = x.detach().clone().requires_grad_()
            r = linear_policy_loss(xg, w, y, token_weight=torch.full((n,), 1.0 / n, device="cuda"),
                                   loss=PolicyLoss(entropy_coef=0.01), backend="triton",
                                   inputs={"old_logprobs": lp_ref.float(), "advantages": torch.ones(n, device="cuda")})
            row["mcore-hooks fused policy logprob"] = err(r.logprob, lp_ref)
            row["mcore-hooks fused policy entropy"] = err(r.entropy, ent_ref)
            del xg, r
            with torch.no_grad():
                slp = torch.log_softmax((x @ w.t()).float(), -1)
                row["stock logprob"] = err(slp.gather(1, y[:, None]).squeeze(1), lp_ref)
                row["stock entropy"] = err(-(slp.exp() * slp).sum(-1), ent_ref)
                del slp
                try:
                    row["Liger logprob"] = err(-_liger_per_token(x, w, y), lp_ref)
                except Exception as e:  # noqa: BLE001
                    row["Liger logprob"] = f"n/a ({type(e).__name__})"
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _liger_per_token(x, w, y):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(reduction="none")(w, x, y)


# --------------------------------------------------------------------------- tensor parallel


def _tp2_worker(rank, port, shape, rep_ms, q):
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        ps, _ = _megatron()
        ps.initialize_model_parallel(2, 1)
        from mcore_hooks.kernels import VocabParallel, linear_logprob_entropy

        n, h, v = shape
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v // 2, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        par = VocabParallel(ps.get_tensor_model_parallel_group(), rank * (v // 2), False)

        def fn(x, w, y):
            r = linear_logprob_entropy(x, w, y, backend="triton", parallel=par)
            return r.logprob.sum() + r.entropy.sum()

        out = {}
        for bwd in (False, True):
            dist.barrier()
            out["fwd+bwd" if bwd else "fwd"] = measure(fn, x, w, y, bwd, rep_ms)
        q.put((rank, out, None))
    except Exception:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def tp2(shape, rep_ms) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp2_worker, args=(r, port, shape, rep_ms, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    for rank, _, tb in res:
        if tb:
            raise RuntimeError(f"rank {rank}: {tb}")
    return {k: max(r[1][k][0] for r in res) for k in ("fwd", "fwd+bwd")}


# --------------------------------------------------------------------------- report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None,
                    help="where the run goes (default: benchmarks/results/postprocess_<gpu>.json, replaced; "
                         "its plot beside it as .png)")
    ap.add_argument("--tp2", action="store_true", help="also time TP=2 on two GPUs (first shape)")
    ap.add_argument("--quick", action="store_true", help="first shape only, shorter timing")
    ap.add_argument("--methods", default=None, help="comma-separated substrings to select methods")
    ap.add_argument("--rep-ms", type=int, default=None, help="timing budget per measurement (ms)")
    ap.add_argument("--shapes", type=int, default=None, help="the first N shapes only")
    ap.add_argument("--grpo-all-shapes", action="store_true", help="GRPO methods at every shape (default: the first)")
    args = ap.parse_args()
    rep_ms = args.rep_ms or (300 if args.quick else 600)

    import torch.distributed as dist
    import triton

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps, _ = _megatron()
    ps.initialize_model_parallel(1, 1)
    import megatron.core

    meta = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__, triton=triton.__version__,
        megatron_core=megatron.core.__version__,
        command="python " + " ".join(sys.argv),
    )
    try:
        import liger_kernel  # noqa: F401

        meta["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
    except ImportError:
        meta["liger_kernel"] = None
    meta["bf16_matmul_TFs"] = round(matmul_ceiling(), 1)
    print(json.dumps(meta), flush=True)

    shapes = SHAPES[:1] if args.quick else SHAPES[: args.shapes] if args.shapes else SHAPES
    methods = [m for m in METHODS if not args.methods or any(s in m[0] for s in args.methods.split(","))]
    results = []
    for n, h, v in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        for name, kind, make in methods:
            if kind.startswith("grpo") and [n, h, v] != list(shapes[0]) and not args.grpo_all_shapes:
                continue
            row = dict(shape=[n, h, v], method=name, kind=kind)
            try:
                fn = make()
            except ImportError as e:
                row["error"] = f"not installed ({e})"
                results.append(row)
                continue
            for bwd in (False, True):
                key = "fwd+bwd" if bwd else "fwd"
                try:
                    ms, mib = measure(fn, x, w, y, bwd, rep_ms)
                    row[key] = dict(ms=round(ms, 2), peak_extra_mib=round(mib, 1))
                except torch.cuda.OutOfMemoryError:
                    row[key] = dict(error="OOM")
                except Exception as e:  # noqa: BLE001
                    row[key] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            results.append(row)
        del x, w, y
        torch.cuda.empty_cache()
    tp2_row = None
    if args.tp2 and torch.cuda.device_count() >= 2:
        dist.destroy_process_group()
        tp2_row = dict(shape=list(SHAPES[0]), **tp2(SHAPES[0], rep_ms))
        print(json.dumps(dict(tp2=tp2_row)), flush=True)
    else:
        ps.destroy_model_parallel()
    acc = accuracy([129920, 151936, 248320] if not args.quick else [151936])
    for r in acc:
        print(json.dumps(r), flush=True)
    blob = dict(meta=meta, results=results, tp2=tp2_row, accuracy=acc)
    from report import default_path, plot, postprocess_lines, run_meta, write_result  # benchmarks/report.py

    meta.setdefault("commit", run_meta()["commit"])
    meta.setdefault("gpu", meta.get("device"))

    path = args.json or default_path("postprocess")
    write_result(path, "bench_postprocess.py", [blob])
    plot(blob, path.rsplit(".", 1)[0] + ".png")
    print("\n".join(postprocess_lines(blob)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
