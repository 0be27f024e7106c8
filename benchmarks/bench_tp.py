"""Tensor-parallel benchmark: mcore-hooks' vocab-parallel paths against the stock path and Liger's
native tensor-parallel loss, at TP = 1, 2, 4, 8, sequence parallelism off and on.

    python benchmarks/bench_tp.py --out DIR                  # one rank per GPU, NCCL, TP 1..8
    python benchmarks/bench_tp.py --tp 2 --check-only        # TP=N against TP=1, per quantity
    python benchmarks/bench_tp.py --emulate --tp 2 4 --check-only   # ranks share GPU 0 over gloo
    python benchmarks/bench_tp.py --cpu --tp 2 4 --check-only       # CPU ranks, torch backend

Methods (bf16 hidden states and output weight, the vocabulary split over the ranks):

- ``hooks``: ``linear_logprob_entropy`` (Triton), log-prob and entropy of every token;
- ``hooks-policy``: ``linear_policy_loss`` (Triton), a GRPO loss with entropy bonus, gradients
  formed in the forward;
- ``stock``: Megatron Core's own pieces as RL frameworks use them: the output layer's
  all-gather (SP) or copy (no SP), bf16 logits, ``vocab_parallel_cross_entropy`` for the
  log-prob and verl's vocab-parallel entropy (three all-reduces, a local backward);
- ``liger-tp``: ``LigerFusedLinearScaledCrossEntropyTPFunction`` on its native CUTLASS + NVSHMEM
  path (Hopper; never its Verl-derived fallback, which is refused). It takes the whole token
  batch and returns a TP-reduced input gradient, so under SP its input is all-gathered and its
  gradient sliced, not reduce-scattered.

Each rank times its own CUDA events (a fixed number of iterations, the same on every rank, so no
rank waits on a collective another never starts); the table gives the slower rank's median and
the larger peak memory beyond the inputs, forward without grad and forward+backward, the
scaling efficiency ``t(TP=1) / (N * t(TP=N))``, and the log-prob's error against float64 on the
first tokens (norm-wise relative, and the largest absolute).

``--check-only`` (or the check that precedes every timing run) compares every processor's
kernel at TP=N with the same kernel at TP=1 on the same inputs: values, dX and this rank's dW
rows, reporting each quantity's largest difference in units of its dtype's epsilon times its
largest magnitude (0: bitwise equal). ``--emulate`` runs the ranks on one GPU over gloo, ``--cpu``
on CPU with the torch backend and a small shape (the check only: timings there mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

SHAPES = [(16384, 4096, 151936), (32768, 8192, 128256)]
CHECK_SHAPE = (2048, 2048, 151936)  # real vocabulary, so the shards are a real model's
GRPO_SEQ = 1024
ACC_TOKENS = 1024
BACKEND = "triton"  # the kernels' backend; ``--cpu`` sets "torch"
CPU_CHECK_SHAPE = (64, 32, 1024)


# --------------------------------------------------------------------------- collectives as autograd


class _GatherTokens(torch.autograd.Function):
    """All-gather along tokens; backward: this rank's slice of a gradient already summed over the
    group (Liger's input gradient is TP-reduced), or reduce-scattered (``reduced=False``)."""

    @staticmethod
    def forward(ctx, x, group, reduced):
        ctx.group, ctx.reduced = group, reduced
        world = dist.get_world_size(group)
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.chunk(world)), x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        if not ctx.reduced:
            g = g.contiguous()
            dist.all_reduce(g, group=ctx.group)
        return g.chunk(world)[rank].contiguous(), None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """verl's vocab-parallel entropy (``verl/utils/megatron/tensor_parallel.py``): fp32, a MAX and
    two SUM all-reduces, the softmax saved, a local backward."""

    @staticmethod
    def forward(ctx, logits, group):
        logits = logits.float()
        m = logits.amax(-1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        p = (logits - m).exp_()
        s = p.sum(-1, keepdim=True)
        dist.all_reduce(s, group=group)
        p.div_(s)
        pz = (p * logits).sum(-1, keepdim=True)
        dist.all_reduce(pz, group=group)
        ctx.save_for_backward(p, logits, pz)
        return (m + s.log() - pz).squeeze(-1)

    @staticmethod
    def backward(ctx, g):
        p, logits, pz = ctx.saved_tensors
        return g[:, None] * p * (pz - logits), None


# --------------------------------------------------------------------------- methods


class Setup:
    """One rank's view: its group, shard and sequence parallelism."""

    def __init__(self, group, rank: int, world: int, vocab: int, sp: bool):
        self.group, self.rank, self.world, self.sp = group, rank, world, sp
        self.v_local = vocab // world
        self.vocab_start = rank * self.v_local

    def parallel(self):
        from mcore_hooks.kernels import VocabParallel

        return VocabParallel(self.group if self.world > 1 else None, self.vocab_start, self.sp and self.world > 1)


def hooks(s: Setup, aux) -> Callable:
    from mcore_hooks.kernels import linear_logprob_entropy

    par = s.parallel()

    def run(x, w, y):
        r = linear_logprob_entropy(x, w, y, backend=BACKEND, parallel=par)
        return r.logprob, r.logprob.sum() + r.entropy.sum()

    return run


def hooks_policy(s: Setup, aux) -> Callable:
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

    par = s.parallel()
    cfg = PolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.001)

    def run(x, w, y):
        old, adv = aux
        tw = torch.full_like(old, 1.0 / old.shape[0])
        r = linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, backend=BACKEND, parallel=par,
                               inputs={"old_logprobs": old, "advantages": adv})
        return r.logprob, r.loss

    return run


def stock(s: Setup, aux) -> Callable:
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region,
                                               vocab_parallel_cross_entropy)

    g = s.group

    def run(x, w, y):
        if s.world > 1 and s.sp:
            x = gather_from_sequence_parallel_region(x, group=g)
        elif s.world > 1:
            x = copy_to_tensor_model_parallel_region(x, group=g)
        logits = (x @ w.t()).unsqueeze(1)  # [s, b=1, V_local] bf16, as the output layer returns
        lp = -vocab_parallel_cross_entropy(logits, y.unsqueeze(1), tp_group=g).squeeze(1)
        ent = _VocabParallelEntropy.apply(logits.squeeze(1), g)
        return lp, lp.sum() + ent.sum()

    return run


def liger_tp(s: Setup, aux) -> Callable:
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
        LigerFusedLinearScaledCrossEntropyTPFunction, _load_native_tp_function, _supports_native_tp_architecture)

    # the frontend falls back to its Verl-derived path, without a word, unless all of these hold
    if _load_native_tp_function() is None or not _supports_native_tp_architecture(torch.device("cuda")):
        raise RuntimeError("Liger's native TP path is unavailable here (liger-cute-kernels or the GPU)")

    def run(x, w, y):
        if s.sp and s.world > 1:
            x = _GatherTokens.apply(x, s.group, True)
        nll, ent = LigerFusedLinearScaledCrossEntropyTPFunction.apply(x, w, y, s.group, return_entropy=True)
        return -nll, ent.sum() - nll.sum()

    return run


METHODS = {"hooks": hooks, "hooks-policy": hooks_policy, "stock": stock, "liger-tp": liger_tp}


def configure_liger(group, device, tokens: int, hidden: int, v_local: int) -> Optional[str]:
    """Liger's collective NVSHMEM set-up for the largest problem; None, or why not."""
    try:
        from liger_kernel.ops.configure import FusedLinearCrossEntropyConfig, configure
    except ImportError as e:
        return f"not installed ({e})"
    try:
        ok = configure(process_groups={"tp": group}, bootstrap_group=group, device=device,
                       flsce=FusedLinearCrossEntropyConfig(max_tokens=tokens, hidden_size=hidden,
                                                           local_vocab_size=v_local, group="tp"))
    except Exception as e:  # noqa: BLE001 - reported in its row; the other methods still run
        return f"configure failed: {type(e).__name__}: {str(e)[:200]}"
    return None if ok else "liger-cute-kernels absent or device unsupported"


# --------------------------------------------------------------------------- measuring


def timed(call: Callable[[], None], iters: int, warmup: int) -> float:
    """This rank's median ms over ``iters`` calls, each between its own CUDA events."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def measure(fn, x, w, y, backward: bool, iters: int, warmup: int, group) -> tuple[float, float]:
    """(slower rank's median ms, larger rank's peak MiB beyond the inputs)."""
    def call():
        if backward:
            x.grad = w.grad = None
            fn(x, w, y)[1].backward()
        else:
            with torch.no_grad():
                fn(x, w, y)

    call()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = timed(call, iters, warmup)
    x.grad = w.grad = None
    out = torch.tensor([ms, peak], dtype=torch.float64, device=x.device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out[0].item(), out[1].item()


def inputs(shape, device, seed: int = 0):
    """The whole problem, identical on every rank: x [N, H], w [V, H], labels [N]."""
    n, h, v = shape
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, generator=g).bfloat16()
    w = (torch.randn(v, h, device=device, generator=g) / math.sqrt(h)).bfloat16()
    y = torch.randint(0, v, (n,), device=device, generator=g)
    return x, w, y


def mine(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank].detach().clone()


# --------------------------------------------------------------------------- TP=N against TP=1


def check_cases(vocab: int):
    """(name, fn(x, w, y, parallel, batch_invariant) -> ({quantity: tensor}, scalar to backward))
    per processor's kernel: log-prob + entropy, selected ids (a teacher's top-k), kept ids (a
    sampling mask replayed), cross-entropy, policy loss. Temperature 0.7 for the first three, 1
    for the losses."""
    from mcore_hooks.kernels import PolicyLoss, linear_cross_entropy, linear_logprob_entropy, linear_policy_loss

    def lpe(x, w, y, par, inv, **kw):
        r = linear_logprob_entropy(x, w, y, backend=BACKEND, parallel=par, temperature=0.7,
                                   batch_invariant=inv, **kw)
        vals = dict(logprob=r.logprob, entropy=r.entropy, logz=r.logz)
        if r.selected is not None:
            vals["selected"] = r.selected
        return vals, sum(v.sum() for v in vals.values() if v.requires_grad)

    def ids(y, k, vocab):  # the label first, then fixed others, distinct per row
        return (y[:, None] + torch.arange(k, device=y.device) * 7919) % vocab

    def ce(x, w, y, par, inv):
        loss = linear_cross_entropy(x, w, y, backend=BACKEND, parallel=par, batch_invariant=inv)
        return dict(loss=loss.detach()), loss

    def policy(x, w, y, par, inv):
        n = y.shape[0]
        g = torch.Generator(device=y.device).manual_seed(3)
        old = -5 + torch.rand(n, device=y.device, generator=g)
        adv = torch.randn(n, device=y.device, generator=g)
        r = linear_policy_loss(x, w, y, token_weight=torch.full((n,), 1.0 / n, device=y.device),
                               loss=PolicyLoss(entropy_coef=0.01), backend=BACKEND, parallel=par,
                               inputs={"old_logprobs": old, "advantages": adv}, batch_invariant=inv)
        return dict(loss=r.loss.detach(), logprob=r.logprob, entropy=r.entropy), r.loss

    def ids_for(y, k):
        return ids(y, k, vocab)

    return [
        ("logprob+entropy", lpe),
        ("selected ids K=8", lambda x, w, y, par, inv: lpe(x, w, y, par, inv, selected_ids=ids_for(y, 8))),
        ("kept ids K=64", lambda x, w, y, par, inv: lpe(x, w, y, par, inv, kept_ids=ids_for(y, 64))),
        ("cross-entropy (sum)", ce),
        ("policy loss", policy),
    ]


def eps_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / (eps * max |b|)`` in ``a``'s dtype: 0 when bitwise equal, at most about 1
    for differences in the last bit of the largest elements (rounding scales with the terms'
    magnitudes, not each result's)."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / (eps * b.abs().max().clamp_min(1e-30))).item()


def check(rank: int, world: int, group, device) -> list[dict]:
    """Every case at TP=N against TP=1 on this rank (the whole weight, no group), SP off and on,
    batch invariance off and on: per quantity (values, dX, this rank's dW rows), the largest
    difference over the ranks in units of its dtype's epsilon."""
    x0, w0, y = inputs(CPU_CHECK_SHAPE if device.type == "cpu" else CHECK_SHAPE, device, seed=1)
    v_local = w0.shape[0] // world
    rows = []
    for name, fn in check_cases(w0.shape[0]):
        for inv in (False, True):
            for sp in ((False, True) if world > 1 else (False,)):
                s = Setup(group, rank, world, w0.shape[0], sp)
                x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                ref, loss = fn(x1, w1, y, Setup(None, 0, 1, w0.shape[0], False).parallel(), inv)
                loss.backward()
                xn = (mine(x0, rank, world) if s.sp else x0.clone()).requires_grad_()
                wn = w0[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
                got, loss = fn(xn, wn, y, s.parallel(), inv)
                loss.backward()
                got.update(dX=xn.grad, dW=wn.grad)
                ref.update(dX=mine(x1.grad, rank, world) if s.sp else x1.grad,
                           dW=w1.grad[rank * v_local:(rank + 1) * v_local])
                diffs = torch.tensor([eps_diff(got[k], ref[k]) for k in got], dtype=torch.float64, device=device)
                diffs = diffs.nan_to_num(nan=math.inf)  # a NaN must not vanish in the MAX
                dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=group)
                rows.append(dict(case=name, batch_invariant=inv, sp=sp, tp=world,
                                 eps_diff=dict(zip(got, diffs.tolist()))))
    return rows


# --------------------------------------------------------------------------- one rank


def method_row(name, s: Setup, aux, xi, w, y, ref, dx_ref, args) -> dict:
    """One method's row on this rank: accuracy on the first tokens (rank 0), then its timings."""
    row: dict = {}
    fn = METHODS[name](s, aux)
    with torch.no_grad():
        got = fn(xi, w, y)[0][:ACC_TOKENS].double()
    xi.grad = w.grad = None
    fn(xi, w, y)[1].backward()
    if ref is not None:
        row["logprob_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        row["logprob_max_abs_err"] = (got - ref).abs().max().item()
        if name != "hooks-policy":  # the others' loss is sum(log-prob + entropy)
            dx = xi.grad[:ACC_TOKENS].double()
            row["dx_rel_err"] = ((dx - dx_ref).norm() / dx_ref.norm()).item()
    for bwd in (False, True):
        ms, mib = measure(fn, xi, w, y, bwd, args.iters, args.warmup, s.group)
        row["fwd+bwd" if bwd else "fwd"] = dict(ms=round(ms, 2), peak_extra_mib=round(mib, 1))
    return row


def worker(rank: int, world: int, port: int, args, q) -> None:
    global BACKEND
    try:
        if args.cpu:
            BACKEND, device = "torch", torch.device("cpu")
        else:
            device = torch.device("cuda", 0 if args.emulate else rank)
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if args.emulate or args.cpu else "nccl",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
        result: dict = dict(tp=world, check=check(rank, world, group, device) if world > 1 else [])
        if args.check_only:
            q.put((rank, result, None))
            return
        shapes = [SHAPES[i] for i in args.shapes]
        liger_note = None
        if "liger-tp" in args.methods:
            liger_note = configure_liger(group, device, max(s[0] for s in shapes), max(s[1] for s in shapes),
                                         max(s[2] for s in shapes) // world)
        rows = []
        for shape in shapes:
            n, h, v = shape
            x, w_full, y = inputs(shape, device)
            w = w_full[rank * (v // world):(rank + 1) * (v // world)].clone().requires_grad_()
            ref = dx_ref = None
            if rank == 0:  # float64 log-probs of the first tokens and the dX of their log-prob + entropy
                x64 = x[:ACC_TOKENS].double().requires_grad_()
                logp = torch.log_softmax(x64 @ w_full.double().t(), -1)
                ref = logp.gather(1, y[:ACC_TOKENS, None]).squeeze(1)
                (ref.sum() - (logp.exp() * logp).sum()).backward()
                ref, dx_ref = ref.detach(), x64.grad
                del logp, x64
            del w_full
            with torch.no_grad():
                lp = hooks(Setup(group, rank, world, v, False), None)(x, w, y)[0]
            g = torch.Generator(device=device).manual_seed(1)
            aux = (lp + 0.3 * (torch.rand(n, device=device, generator=g) - 0.5),
                   torch.randn(n // GRPO_SEQ, device=device, generator=g).repeat_interleave(GRPO_SEQ))
            for sp in ((False, True) if world > 1 else (False,)):
                s = Setup(group, rank, world, v, sp)
                xi = (mine(x, rank, world) if sp else x.clone()).requires_grad_()
                for name in args.methods:
                    row = dict(shape=list(shape), tp=world, sp=sp, method=name)
                    if name == "liger-tp" and liger_note:
                        row["error"] = liger_note
                        rows.append(row)
                        continue
                    err = None
                    try:
                        row.update(method_row(name, s, aux, xi, w, y, ref, dx_ref, args))
                    except torch.cuda.OutOfMemoryError:
                        err = "OOM"
                    except Exception as e:  # noqa: BLE001 - a method's refusal is its row's result
                        err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
                    torch.cuda.empty_cache()
                    # The ranks agree on the outcome. A failure on every rank at the same point
                    # (an OOM or a kernel's refusal at one shape) leaves them in step; one on a
                    # single rank mid-collective cannot be recovered from: NCCL's watchdog or
                    # run_tp's deadline ends the run.
                    failed = torch.tensor([1.0 if err else 0.0], device=device)
                    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
                    if err or failed.item():
                        row = {k: row[k] for k in ("shape", "tp", "sp", "method")}
                        row["error"] = err or "failed on another rank"
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                    rows.append(row)
                del xi
            del x, w, y, aux, lp, ref, dx_ref
            torch.cuda.empty_cache()
        result["rows"] = rows
        q.put((rank, result, None))
    except Exception:  # noqa: BLE001 - a rank's failure is reported, not left to hang its peers
        q.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_tp(world: int, args) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # daemons: a parent killed by a timeout takes its ranks (and their GPU memory) with it
    procs = [ctx.Process(target=worker, args=(r, world, port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    res, deadline = [], time.monotonic() + args.timeout
    try:
        while len(res) < world:  # the first rank to fail ends the run, with its traceback
            try:
                rank, out, tb = q.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"TP={world}: ranks {dead} died without a word (a native abort?)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"TP={world}: timed out after {args.timeout} s")
                continue
            if tb:
                raise RuntimeError(f"TP={world}, rank {rank}:\n{tb}")
            res.append((rank, out))
    finally:
        for p in procs:
            if len(res) < world:
                p.kill()
            p.join(60)
    return min(res, key=lambda r: r[0])[1]


# --------------------------------------------------------------------------- report


def report(meta: dict, results: list[dict]) -> str:
    lines = [f"- date: {meta['date']}", f"- device: {meta['gpus']} x {meta['device']}",
             f"- torch {meta['torch']}, Triton {meta['triton']}, Megatron Core {meta['megatron_core']}, "
             f"Liger-Kernel {meta['liger_kernel']}", f"- command: `{meta['command']}`", ""]
    base = {(tuple(r["shape"]), r["method"]): r for res in results for r in res.get("rows", []) if r["tp"] == 1}
    rows = [r for res in results for r in res.get("rows", [])]
    if rows:
        lines += ["| shape | TP | SP | method | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd MiB | "
                  "efficiency fwd / fwd+bwd | log-prob rel / max abs err | dX rel err |", "|" + "---|" * 11]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['tp']} | {r['sp']} | {r['method']} | {r['error']} |||||||")
                continue
            b = base.get((tuple(r["shape"]), r["method"]))
            eff = " / ".join(f"{b[k]['ms'] / (r['tp'] * r[k]['ms']):.2f}" if b and k in b else "-"
                             for k in ("fwd", "fwd+bwd"))
            acc = (f"{r['logprob_rel_err']:.1e} / {r['logprob_max_abs_err']:.1e}" if "logprob_rel_err" in r else "-")
            lines.append(f"| {r['shape']} | {r['tp']} | {r['sp']} | {r['method']} | {r['fwd']['ms']} | "
                         f"{r['fwd']['peak_extra_mib']} | {r['fwd+bwd']['ms']} | {r['fwd+bwd']['peak_extra_mib']} | "
                         f"{eff} | {acc} | {format(r['dx_rel_err'], '.1e') if 'dx_rel_err' in r else '-'} |")
    lines += [f"TP={res['tp']} failed: {res['error'].strip().splitlines()[-1]}" for res in results if "error" in res]
    checks = [c for res in results for c in res.get("check", [])]
    if checks:
        shape = list(CPU_CHECK_SHAPE if meta["gpus"] == 0 else CHECK_SHAPE)
        lines += ["", f"TP=N against TP=1, shape {shape}: each quantity's largest difference in units of its "
                  "dtype's epsilon times its largest magnitude (0: bitwise equal; dX and dW in the inputs' "
                  "dtype, values float32):", "",
                  "| case | TP | SP | invariant | bitwise | differing (eps) |", "|" + "---|" * 6]
        for c in checks:
            same = [k for k, d in c["eps_diff"].items() if d == 0]
            other = [f"{k} {d:.2g}" for k, d in c["eps_diff"].items() if d != 0]
            lines.append(f"| {c['case']} | {c['tp']} | {c['sp']} | {c['batch_invariant']} | {', '.join(same)} | "
                         f"{', '.join(other)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/out", help="the markdown report's folder")
    ap.add_argument("--json", default=None,
                    help="where the results go (default: benchmarks/results/tp_<gpu>.json, replaced)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", type=int, nargs="+", default=[0, 1], help="indices into SHAPES")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-only", action="store_true", help="TP=N against TP=1 only, no timing")
    ap.add_argument("--emulate", action="store_true", help="all ranks on GPU 0 over gloo (with --check-only)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks, torch backend, small shape (with --check-only)")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    if (args.emulate or args.cpu) and not args.check_only:
        ap.error("--emulate and --cpu are for --check-only: timings there mean nothing")
    os.makedirs(args.out, exist_ok=True)
    gpus = 0 if args.cpu else torch.cuda.device_count()

    try:
        import megatron.core as mc
        mcore = mc.__version__
    except ImportError:
        mcore = None
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("triton", "liger_kernel"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0) if gpus else "CPU",
                gpus=gpus, torch=torch.__version__, triton=versions.get("triton"),
                megatron_core=mcore, liger_kernel=versions.get("liger_kernel"),
                command="python " + " ".join(sys.argv))
    print(json.dumps(meta), flush=True)
    results = []
    for world in args.tp:
        if world > gpus and not (args.emulate or args.cpu):
            print(json.dumps(dict(tp=world, skipped=f"{gpus} GPU(s)")), flush=True)
            continue
        try:
            res = run_tp(world, args)
        except RuntimeError as e:  # this degree's failure is its result; the others still run
            res = dict(tp=world, error=str(e)[-4000:])
            print(res["error"], flush=True)
        for c in res.get("check", []):
            print(json.dumps(c), flush=True)
        results.append(res)
        from report import default_path, run_meta, write_result  # benchmarks/report.py

        meta.setdefault("commit", run_meta()["commit"])

        write_result(args.json or default_path("tp"), "bench_tp.py",  # after every degree
                     [dict(meta=meta, results=results)])
    text = report(meta, results)
    with open(os.path.join(args.out, "bench_tp.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
