"""Speed at every shape users run: the entry points and the bundled processors (through the hook)
beside the stock logits path and Liger, over real model shapes, on one GPU.

    python benchmarks/bench_sweep.py [--hidden 896 ...] [--tokens 256 ...] [--vocab 151936 ...]
                                     [--section entry hook] [--rounds 5] [--json out.json]

For each shape (tokens x hidden x vocab, bf16) and path, forward+backward (gradients to the
hidden states and the output weight), it reports:

* ``wall``: median ms of back-to-back calls (Triton's ``do_bench``, CUDA events around them): the
  GPU time where the GPU is the bottleneck, the host's where the host is; with ``--rounds R``,
  the median of R such timings, a cell's paths taking turns, and each ratio to stock the median
  of the rounds' ratios (``wall_rounds`` keeps them);
* ``gpu``: ms of device work in one call (the sum of its kernels' durations, CUPTI through
  ``torch.profiler``: no gaps);
* ``host``: ms the host takes to issue one call, forward and backward (``time.perf_counter``
  around it, the device idle and synchronised before, none after; median of 7);
* ``host_b2b``: ms the host takes per call issuing calls back to back, the gradients cleared
  before each as ``wall``'s calls do (no synchronisation between them, one after: the least of
  3 runs of as many calls as keep the launch queue from filling, so a call the GPU is slower at
  still shows the host's work; but a path that waits on the device, as Megatron's
  ``vocab_parallel_cross_entropy`` does at 2048 x 151936, shows the GPU's time);
* ``launches``: kernels, copies and fills one call puts on the device;
* ``mem``: peak MiB allocated during one call beyond what was allocated before it.

Sections: ``entry``, the kernels' entry points (``linear_logprob_entropy``,
``linear_cross_entropy``, ``linear_policy_loss``, ``linear_policy_loss`` into a float32
``main_grad``, with and without a declared ``upstream_grad``) beside the stock paths (the
``[tokens, vocab]`` logits, float32 ``log_softmax``, the same loss in torch; Megatron's
``vocab_parallel_cross_entropy``) and Liger's fused linear cross-entropy; ``hook``, every bundled
processor and both integrations called with the hook's keywords (a one-layer GPTModel's output
layer, its weight replaced by a ``[vocab, hidden]`` one: the processors' argument checks and
context handling included), with ``main_grad`` where the config asks for
``gradient_accumulation_fusion``. A path that runs out of memory is reported ``OOM``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import STOCK_OF, default_path, load_rows, ratio, run_meta, summary, write_result  # noqa: E402

HIDDEN = [896, 1024, 1536, 2048, 3584, 4096, 8192]
TOKENS = [256, 512, 2048, 8192, 32768]
VOCAB = [151936, 32000]


# --------------------------------------------------------------------------- measuring one path


def _kernels(prof) -> tuple[float, int]:
    """(ms of device work, launches) of a profiled call."""
    ms, n = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
            n += 1
    return ms, n


def measure(step: Callable[[], None], grads: list) -> dict:
    """One path: wall, gpu, host, launches, mem (see the module docstring). Calls longer than
    20 ms take 3 host samples and the median of 5 timed calls for wall (the host's share is
    nothing there); shorter ones 7 host samples and ``do_bench``."""
    run = _cleared(step, grads)
    try:
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        long = start.elapsed_time(end) > 20
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        mem = (torch.cuda.max_memory_allocated() - before) / 2**20
        hosts = []
        for _ in range(3 if long else 7):
            for t in grads:
                t.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        gpu, launches = _kernels(prof)
        # the queue holds about a thousand launches; past that the host would wait on the GPU
        # (a long call: a couple, its host's share is nothing there)
        calls = 2 if long else max(1, min(50, 600 // max(1, launches)))
        b2b = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            b2b.append((time.perf_counter() - t0) * 1e3 / calls)
        torch.cuda.synchronize()
        wall = _wall(run, long)
    except torch.OutOfMemoryError:
        for t in grads:
            t.grad = None
        torch.cuda.empty_cache()
        return {"oom": True}
    for t in grads:
        t.grad = None
    return {"wall": wall, "gpu": gpu, "host": statistics.median(hosts), "host_b2b": min(b2b),
            "launches": launches, "mem": mem, "long": long}


def _cleared(step: Callable[[], None], grads: list) -> Callable[[], None]:
    """``step`` with the gradients cleared before it, as every timed call runs it."""
    def run():
        for t in grads:
            t.grad = None
        step()

    return run


def _wall(run: Callable[[], None], long: bool) -> float:
    """Median ms of back-to-back calls: ``do_bench``'s, or for a long call 5 timed one by one."""
    import triton.testing

    if not long:
        return triton.testing.do_bench(run, warmup=20, rep=120, return_mode="median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
    return statistics.median(walls)


def measure_cell(steps: dict[str, tuple[Callable[[], None], list]], rounds: int) -> dict[str, dict]:
    """Every path of one cell: :func:`measure` once each, then with ``rounds`` > 1 the wall again
    ``rounds - 1`` times, the paths taking turns (each round starting one path later), so that
    a path and its stock path are timed seconds apart, never a whole sweep apart: the
    host-bound cells' walls move by up to half between runs, and a sweep run path by path puts
    that drift into the ratios. Each row keeps its rounds' walls (``wall_rounds``) and ``wall``
    becomes their median; :func:`ratio` takes the median of the per-round ratios."""
    rows = {name: measure(step, grads) for name, (step, grads) in steps.items()}
    names = [n for n in steps if not rows[n].get("oom")]
    for n in names:
        rows[n]["wall_rounds"] = [rows[n]["wall"]]
    for r in range(1, rounds if names else 1):
        for n in names[r % len(names):] + names[:r % len(names)]:
            if rows[n].get("oom"):
                continue
            try:
                rows[n]["wall_rounds"].append(_wall(_cleared(*steps[n]), rows[n]["long"]))
            except torch.OutOfMemoryError:  # beside another path's memory: reported so
                rows[n] = {"oom": True}
                torch.cuda.empty_cache()
        for t in {id(t): t for _, g in steps.values() for t in g}.values():
            t.grad = None
    for n in names:
        if not rows[n].get("oom"):
            rows[n]["wall"] = statistics.median(rows[n]["wall_rounds"])
    return rows


# --------------------------------------------------------------------------- the entry points


GRPO_SEQ = 256  # tokens per sequence: one advantage each (GRPO)


class _IntoMainGrad(torch.autograd.Function):
    """``x @ w.T`` whose backward adds the weight's gradient into a float32 ``main_grad`` (one
    GEMM with float32 accumulation, as Megatron's wgrad with gradient_accumulation_fusion)."""

    @staticmethod
    def forward(ctx, x, w, main_grad):
        ctx.save_for_backward(x, w)
        ctx.main_grad = main_grad
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        from mcore_hooks.kernels.common.matmul import addmm_f32_

        x, w = ctx.saved_tensors
        addmm_f32_(ctx.main_grad, g.t(), x)
        return g @ w, None, None


def _policy():
    from mcore_hooks.kernels import PolicyLoss

    return PolicyLoss(clip_low=0.2, clip_high=0.28)


def entry_paths(x, w, y, main_grad, liger) -> dict[str, Callable[[], None]]:
    from megatron.core import tensor_parallel

    from mcore_hooks.kernels import linear_cross_entropy, linear_logprob_entropy, linear_policy_loss

    n = y.shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    old = -2 * torch.rand(n, device="cuda", generator=g)
    adv = torch.randn(-(-n // GRPO_SEQ), device="cuda", generator=g).repeat_interleave(GRPO_SEQ)[:n]
    inputs = {"old_logprobs": old, "advantages": adv}
    tw = torch.full((n,), 1.0 / n, device="cuda")
    cfg = _policy()

    def stock_logp():
        logits = (x @ w.t()).float()
        return torch.log_softmax(logits, dim=-1)

    def stock_lp():
        logp = stock_logp()
        lp = logp.gather(1, y[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
        (lp.sum() + ent.sum()).backward()

    def stock_ce():
        logits = (x @ w.t()).view(n, 1, -1)
        tensor_parallel.vocab_parallel_cross_entropy(logits, y.view(n, 1)).sum().backward()

    def stock_policy():
        lp = stock_logp().gather(1, y[:, None]).squeeze(1)
        (cfg(lp, None, **inputs) * tw).sum().backward()

    def stock_policy_main_grad():
        # Megatron's output layer with gradient_accumulation_fusion: its weight-gradient GEMM
        # accumulates into the float32 main_grad (no bf16 dW)
        lp = torch.log_softmax(_IntoMainGrad.apply(x, w, main_grad).float(), dim=-1)
        (cfg(lp.gather(1, y[:, None]).squeeze(1), None, **inputs) * tw).sum().backward()

    def lp():
        r = linear_logprob_entropy(x, w, y)
        (r.logprob.sum() + r.entropy.sum()).backward()

    def ce():
        linear_cross_entropy(x, w, y).backward()

    def policy():
        linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, inputs=inputs).loss.backward()

    def policy_main_grad():
        linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, inputs=inputs,
                           weight_grad_accumulator=main_grad).loss.backward()

    def policy_main_grad_declared():
        linear_policy_loss(x, w, y, token_weight=tw, loss=cfg, inputs=inputs,
                           weight_grad_accumulator=main_grad, upstream_grad=1.0).loss.backward()

    paths = {"stock_lp": stock_lp, "lp": lp, "stock_ce": stock_ce, "ce": ce,
             "stock_policy": stock_policy, "policy": policy,
             "stock_policy_main_grad": stock_policy_main_grad, "policy_main_grad": policy_main_grad,
             "policy_main_grad_declared": policy_main_grad_declared}
    if liger is not None:
        paths["liger_ce"] = lambda: liger(w, x, y).backward()
    return paths


def _liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")


def run_entry(hidden, tokens, vocab, only=None, rounds: int = 1) -> list[dict]:
    rows = []
    liger = _liger()
    for v in vocab:
        for h in hidden:
            g = torch.Generator(device="cuda").manual_seed(h + v)
            w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
            main_grad = torch.zeros(v, h, device="cuda")
            for n in tokens:
                x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
                y = torch.randint(0, v, (n,), device="cuda", generator=g)
                steps = {name: (step, [x, w]) for name, step in entry_paths(x, w, y, main_grad, liger).items()
                         if not only or name in only}
                for name, r in measure_cell(steps, rounds).items():
                    rows.append(dict(section="entry", path=name, tokens=n, hidden=h, vocab=v, **r))
                    print(json.dumps(rows[-1]), flush=True)
                del x, y
            del w, main_grad
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- through the hook


def _hook_keywords(h: int, v: int):
    """A one-layer bf16 GPTModel's hook keywords (its output layer's weight replaced by a
    ``[v, h]`` one), and the model (kept alive with them)."""
    from mcore_hooks import hooked_class
    from mcore_hooks.processors import FusedLogprobProcessor
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, stock_model_class, tiny_batch

    cfg = TinyModelConfig(tied=False, params_dtype=torch.bfloat16, vocab_size=128, hidden_size=64,
                          num_layers=1)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class("gpt"))).cuda()
    batch = {k: t.cuda() if torch.is_tensor(t) else t for k, t in tiny_batch(cfg, batch_size=1).items()}
    seen: dict = {}

    def grab(**kwargs):
        seen.update(kwargs)
        return FusedLogprobProcessor()(**kwargs)

    model(**batch, output_processor=grab)
    g = torch.Generator(device="cuda").manual_seed(h + v)
    layer = seen["output_layer"]
    layer.weight = torch.nn.Parameter((torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16())
    return model, seen


def _with_tokens(seen: dict, n: int, h: int, v: int, main_grad: bool) -> tuple[dict, list]:
    g = torch.Generator(device="cuda").manual_seed(n)
    kw = dict(seen)
    hidden = torch.randn(n, 1, h, device="cuda", generator=g).bfloat16().requires_grad_()
    kw.update(hidden_states=hidden, labels=torch.randint(0, v, (1, n), device="cuda", generator=g),
              loss_mask=torch.ones(1, n, device="cuda"), input_ids=None, position_ids=None,
              attention_mask=None, decoder_input=None)
    weight = kw["output_layer"].weight
    config = copy.copy(kw["config"])
    config.gradient_accumulation_fusion = main_grad
    kw["config"] = config
    if main_grad:
        weight.main_grad = torch.zeros(v, h, device="cuda")
        weight.grad_added_to_main_grad = False
    else:
        for attr in ("main_grad", "grad_added_to_main_grad"):
            if hasattr(weight, attr):
                delattr(weight, attr)
    return kw, [hidden, weight]


def hook_processors():
    from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
    from mcore_hooks.integrations.verl import VerlFusedProcessor
    from mcore_hooks.processors import (
        EntropyProcessor, FusedLogprobProcessor, LinearCEProcessor, LogprobEntropyProcessor,
        PolicyLossProcessor, SelectedLogprobProcessor, TopKDistillationProcessor)

    return {
        "FusedLogprobProcessor": FusedLogprobProcessor(),
        "EntropyProcessor": EntropyProcessor(),
        "LogprobEntropyProcessor": LogprobEntropyProcessor(),
        "LinearCEProcessor(mean)": LinearCEProcessor(reduction="mean"),
        "PolicyLossProcessor": PolicyLossProcessor(loss=_policy()),
        "SelectedLogprobProcessor": SelectedLogprobProcessor(),
        "TopKDistillationProcessor": TopKDistillationProcessor(),
        "VerlFusedProcessor": VerlFusedProcessor(),
        "NemoRLLogprobProcessor": NemoRLLogprobProcessor(),
    }


def _context(name: str, n: int, v: int) -> Optional[dict]:
    g = torch.Generator(device="cuda").manual_seed(7)
    if name.startswith("PolicyLoss"):
        return {"old_logprobs": -2 * torch.rand(1, n, device="cuda", generator=g),
                "advantages": torch.randn(1, n, device="cuda", generator=g)}
    if name.startswith("Selected"):
        return {"selected_ids": torch.randint(0, v, (1, n, 8), device="cuda", generator=g)}
    if name.startswith("TopK"):
        return {"teacher_ids": torch.randint(0, v, (1, n, 8), device="cuda", generator=g),
                "teacher_logprobs": -2 * torch.rand(1, n, 8, device="cuda", generator=g) - 1}
    return None


def _scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        if "loss" in out:
            return out["loss"]
        return sum(t.float().sum() for t in out.values() if t.is_floating_point() and t.requires_grad)
    if isinstance(out, tuple):
        return sum(t.float().sum() for t in out if torch.is_tensor(t) and t.requires_grad)
    return out.log_probs.sum() + (out.entropy.sum() if getattr(out, "entropy", None) is not None else 0)


def run_hook(hidden, tokens, vocab, rounds: int = 1) -> list[dict]:
    rows = []
    processors = hook_processors()
    for v in vocab:
        for h in hidden:
            model, seen = _hook_keywords(h, v)
            for n in tokens:
                # in turns within each group: the weight has a main_grad only while the second's
                # paths run (a V x H float32 tensor the others need no memory for)
                for main_grad in (False, True):
                    kw, grads = _with_tokens(seen, n, h, v, main_grad)
                    steps = {}
                    for name, proc in processors.items():
                        if main_grad and name not in ("LogprobEntropyProcessor", "PolicyLossProcessor"):
                            continue
                        args = dict(kw, context=_context(name, n, v))

                        def step(proc=proc, args=args):
                            _scalar(proc(**args)).backward()

                        steps[name + (" main_grad" if main_grad else "")] = (step, grads)
                    for name, r in measure_cell(steps, rounds).items():
                        rows.append(dict(section="hook", path=name, tokens=n, hidden=h, vocab=v, **r))
                        print(json.dumps(rows[-1]), flush=True)
            del model, seen
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- report


def table(rows: list[dict], section: str) -> str:
    """Markdown: a row per shape and path, its numbers, and the ratio of wall to the same
    objective's stock path where there is one."""
    stock_of = STOCK_OF
    by = {(r["tokens"], r["hidden"], r["vocab"], r["path"]): r for r in rows if r["section"] == section}
    out = ["| tokens | hidden | vocab | path | wall ms | x stock | gpu ms | host ms | host ms b2b | launches | MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (n, h, v, path), r in sorted(by.items()):
        if r.get("oom"):
            out.append(f"| {n} | {h} | {v} | {path} | OOM | | | | | | |")
            continue
        s = by.get((n, h, v, stock_of.get(path, "")))
        ratio_ = "" if s is None or s.get("oom") else f"{ratio(r, s):.2f}"
        out.append(f"| {n} | {h} | {v} | {path} | {r['wall']:.2f} | {ratio_} | {r['gpu']:.2f} | "
                   f"{r['host']:.2f} | {r.get('host_b2b', float('nan')):.2f} | {r['launches']} | {r['mem']:.0f} |")
    return "\n".join(out)


def host_profile(path: str, n: int, h: int, v: int, calls: int = 30) -> None:
    """cProfile of ``calls`` calls of one path (an entry path's or a processor's name): where the
    host's time goes, the 25 functions of most time of their own."""
    import cProfile
    import pstats

    if path in hook_processors():
        model, seen = _hook_keywords(h, v)
        kw, grads = _with_tokens(seen, n, h, v, False)
        proc = hook_processors()[path]
        args = dict(kw, context=_context(path, n, v))

        def step():
            _scalar(proc(**args)).backward()
    else:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(v, h, device="cuda", generator=g) / math.sqrt(h)).bfloat16().requires_grad_()
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        grads = [x, w]
        step = entry_paths(x, w, y, torch.zeros(v, h, device="cuda"), None)[path]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(calls):
        for t in grads:
            t.grad = None
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    print(f"--- host profile of {path} at {n} x {h} x {v}, {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kp:
        step()
        torch.cuda.synchronize()
    print(f"--- kernels of one call of {path}")
    print(kp.key_averages().table(sort_by="cuda_time_total", row_limit=20))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=HIDDEN)
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    ap.add_argument("--vocab", type=int, nargs="+", default=VOCAB)
    ap.add_argument("--section", nargs="+", default=["entry", "hook"], choices=["entry", "hook"])
    ap.add_argument("--json", default=None,
                    help="where the rows go (default: benchmarks/results/sweep_<gpu>.json, replaced)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each cell's walls this many times, its paths taking turns; ratios "
                         "are the medians of the rounds' (host-bound cells drift between runs)")
    ap.add_argument("--paths", nargs="+", default=None, help="entry paths to run (default: all)")
    ap.add_argument("--route", default="auto", choices=["auto", "forward", "backward"],
                    help="where the fused losses form their gradients on Triton: as the hidden "
                         "size chooses, or always in the forward / the backward (to measure both)")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the summary of these runs' rows (a --json file or a run's printed "
                         "JSON lines; no GPU needed) and exit")
    ap.add_argument("--host-profile", nargs="+", default=None, metavar="PATH",
                    help="cProfile these paths at the first tokens / hidden / vocab instead")
    args = ap.parse_args()
    if args.report:
        print(summary([r for f in args.report for r in load_rows(f)]))
        return 0
    from mcore_hooks.testing import model_parallel, quiet_megatron

    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"command: {' '.join(sys.argv)}", flush=True)
    if args.route != "auto":
        from mcore_hooks.kernels.triton_backend import triton_fused

        triton_fused.TritonFused.forward_gradients_min_hidden = 0 if args.route == "forward" else 1 << 30
    rows: list[dict] = []
    if args.host_profile:
        with quiet_megatron(), model_parallel(tp=1):
            for path in args.host_profile:
                host_profile(path, args.tokens[0], args.hidden[0], args.vocab[0])
        return 0
    with quiet_megatron(), model_parallel(tp=1):
        if "entry" in args.section:
            rows += run_entry(args.hidden, args.tokens, args.vocab, args.paths, args.rounds)
        if "hook" in args.section:
            rows += run_hook(args.hidden, args.tokens, args.vocab, args.rounds)
    write_result(args.json or default_path("sweep"), "bench_sweep.py", [{"meta": run_meta(), "rows": rows}])
    for section in args.section:
        print(table(rows, section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
