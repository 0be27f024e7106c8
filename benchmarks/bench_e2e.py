"""End to end: a GRPO micro-step on a Qwen2.5-1.5B-shaped GPTModel, stock logits against the
processors (one GPU), under each activation-recompute choice, with the optimizer's memory held.

The model: 28 layers, hidden 1536, 12 heads in 2 query groups, FFN 8960 (SwiGLU), vocab 151936,
tied embeddings, RMSNorm, RoPE, Megatron Core's local spec, bf16, sequences of 2048. Activation
recomputation (``--recompute``): ``full`` (every layer, uniform, one layer a checkpoint),
``selective`` (Megatron's default: the core attention) or ``none``. The step: forward, a
clipped-ratio policy loss (token mean) over the sampled tokens, backward. Three ways:

* ``stock``: the model's logits, float32 ``log_softmax``, the selected log-probs, the loss in torch;
* ``logprob-entropy``: ``LogprobEntropyProcessor`` through the hook, the loss in torch;
* ``policy-loss``: ``PolicyLossProcessor`` (the loss fused with the output layer).

The optimizer's state is held on the GPU while the steps run, as a trainer holds it: Megatron's
float32 ``main_grad`` buffer (4 bytes a parameter) and Adam's float32 master weights and two
moments (12 bytes a parameter) sharded over ``--dp`` data-parallel ranks by the distributed
optimizer (``--dp 0``: none held). The step's own bf16 gradients (2 bytes a parameter, which
Megatron's DDP would not hold beside ``main_grad``) are on top: a conservative count. The
optimizer's own step is not timed.

For each recompute choice and micro-batch size (8k, 16k, 32k, 64k tokens): the median step time,
the peak memory, whether it fits, and (where stock fits) the loss and the output weight's
gradient against ``policy-loss``; then, per path and micro-batch size, the fastest recompute
choice that fits (the best fit). Usage (on the GPU machine, Megatron Core carried):
``python benchmarks/bench_e2e.py [--tokens 8192 ...] [--recompute full selective none] [--dp 8]
[--steps 3] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

SEQ = 2048
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def build_model(recompute: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mcore_hooks import hooked_class

    how = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
           "selective": dict(recompute_granularity="selective"),  # Megatron's default: core attention
           "none": {}}[recompute]
    config = TransformerConfig(
        num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2,
        ffn_hidden_size=8960, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, add_qkv_bias=True, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6, **how,
    )
    spec_kwargs = {}
    if "normalization" in inspect.signature(get_gpt_layer_local_spec).parameters:
        spec_kwargs["normalization"] = "RMSNorm"
    model = hooked_class(GPTModel)(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(**spec_kwargs),
        vocab_size=151936, max_sequence_length=SEQ, position_embedding_type="rope",
        rotary_base=1000000, share_embeddings_and_output_weights=True,
    )
    return model.cuda()


def batch(tokens: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = tokens // SEQ
    ids = torch.randint(0, 151936, (b, SEQ + 1), device="cuda", generator=g)
    return dict(
        input_ids=ids[:, :-1], labels=ids[:, 1:].contiguous(),
        position_ids=torch.arange(SEQ, device="cuda").expand(b, SEQ),
        mask=(torch.rand(b, SEQ, device="cuda", generator=g) > 0.1).float(),
        old=-2.0 + 0.1 * torch.randn(b, SEQ, device="cuda", generator=g),
        adv=torch.randn(b, SEQ, device="cuda", generator=g),
    )


def grpo(logprobs, d):
    ratio = torch.exp(logprobs - d["old"])
    pg = torch.maximum(-d["adv"] * ratio, -d["adv"] * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    return (pg * d["mask"]).sum() / d["mask"].sum().clamp(min=1)


def step(model, method: str, d: dict) -> torch.Tensor:
    method = method.split(" ")[0]
    from mcore_hooks import LogprobEntropyProcessor, PolicyLossProcessor
    from mcore_hooks.kernels import PolicyLoss

    common = dict(input_ids=d["input_ids"], position_ids=d["position_ids"], attention_mask=None)
    if method == "stock":
        logits = model(**common)  # [b, s, V] bf16
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(-1, d["labels"].unsqueeze(-1)).squeeze(-1)
        loss = grpo(lp, d)
    elif method == "logprob-entropy":
        out = model(**common, labels=d["labels"], output_processor=LogprobEntropyProcessor())
        loss = grpo(out["logprobs"], d)
    else:
        out = model(**common, labels=d["labels"], loss_mask=d["mask"],
                    output_processor=PolicyLossProcessor(loss=PolicyLoss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)),
                    output_processor_context={"old_logprobs": d["old"], "advantages": d["adv"]})
        loss = out["loss"]
    loss.backward()
    return loss.detach()


def measure(model, method: str, tokens: int, steps: int) -> dict:
    d = batch(tokens)
    times = []
    try:
        for i in range(steps + 1):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(model, method, d)
            end.record()
            torch.cuda.synchronize()
            if i:  # the first step warms up (Triton compilation, allocator)
                times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated()
        grad = model.embedding.word_embeddings.weight.grad.float().clone()
        return dict(method=method, tokens=tokens, fits=True, ms=statistics.median(times),
                    peak_extra_mib=round((peak - base) / 2**20), peak_mib=round(peak / 2**20),
                    loss=float(loss), grad=grad)
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return dict(method=method, tokens=tokens, fits=False)


def optimizer_state(model, dp: int) -> torch.Tensor:
    """What the optimizer holds on this GPU, as one allocation: a float32 main_grad a parameter
    and Adam's float32 master weights and moments, sharded over ``dp`` ranks."""
    params = sum(p.numel() for p in model.parameters())
    per_param = 4 + 12 / dp if dp else 0
    return torch.empty(int(params * per_param), dtype=torch.uint8, device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--recompute", nargs="+", default=["full", "selective", "none"],
                        choices=["full", "selective", "none"])
    parser.add_argument("--dp", type=int, default=8,
                        help="data-parallel ranks the optimizer's state is sharded over (0: none held)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None,
                        help="where the rows go (default: benchmarks/results/e2e_<gpu>.json, replaced)")
    parser.add_argument("--repeat", action="store_true", help="run policy-loss twice (run-to-run noise)")
    args = parser.parse_args()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    rows = []
    methods = ("policy-loss", "logprob-entropy", "stock")
    print(f"# {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB), "
          f"torch {torch.__version__}, bf16, seq {SEQ}, optimizer state for DP={args.dp} held")
    print("| recompute | tokens | method | ms | peak MiB | peak extra MiB | loss | loss vs policy-loss | "
          "output-weight grad vs policy-loss | vs stock |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for recompute in args.recompute:
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        model = build_model(recompute)
        state = optimizer_state(model, args.dp)
        for tokens in args.tokens:
            results = {m: measure(model, m, tokens, args.steps) for m in methods}
            if args.repeat:  # the same step again: run-to-run (a bitwise-stable path gives 0)
                results["policy-loss (again)"] = measure(model, "policy-loss", tokens, args.steps)
            ref, st = results["policy-loss"], results["stock"]
            for m, r in results.items():
                r["recompute"] = recompute
                if not r["fits"]:
                    print(f"| {recompute} | {tokens} | {m} | out of memory | | | | | | |")
                    rows.append(dict(r))
                    continue
                dl = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30) if ref["fits"] else float("nan")
                dg = float((r["grad"] - ref["grad"]).norm() / ref["grad"].norm()) if ref["fits"] else float("nan")
                ds = float((r["grad"] - st["grad"]).norm() / st["grad"].norm()) if st["fits"] else float("nan")
                print(f"| {recompute} | {tokens} | {m} | {r['ms']:.1f} | {r['peak_mib']} | {r['peak_extra_mib']} "
                      f"| {r['loss']:.6f} | {dl:.1e} | {dg:.1e} | {ds:.1e} |")
                rows.append({k: v for k, v in r.items() if k != "grad"}
                            | {"loss_rel": dl, "grad_rel": dg, "grad_rel_stock": ds})
            del results, ref, st  # the gradients' copies
            sys.stdout.flush()
        del model, state
        torch.cuda.empty_cache()
    print(f"\nBest fit (the fastest recompute choice that fits, optimizer state for DP={args.dp} held):")
    print("| tokens | method | recompute | ms | peak MiB | vs stock's best |\n|---|---|---|---|---|---|")
    best = {}
    for tokens in args.tokens:
        for m in methods:
            fit = [r for r in rows if r["tokens"] == tokens and r["method"] == m and r["fits"]]
            best[(tokens, m)] = min(fit, key=lambda r: r["ms"]) if fit else None
        for m in methods:
            b, s = best[(tokens, m)], best[(tokens, "stock")]
            if b is None:
                print(f"| {tokens} | {m} | nothing fits | | | |")
                continue
            speed = f"{s['ms'] / b['ms']:.2f}x" if s is not None else "stock does not fit"
            print(f"| {tokens} | {m} | {b['recompute']} | {b['ms']:.1f} | {b['peak_mib']} | {speed} |")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import default_path, run_meta, write_result  # benchmarks/report.py

    write_result(args.json or default_path("e2e"), "bench_e2e.py",
                 [{"meta": run_meta(dp=args.dp), "rows": rows,
                   "best": [dict(tokens=t, method=m, **({} if b is None else
                                                        {k: b[k] for k in ("recompute", "ms", "peak_mib")}))
                            for (t, m), b in best.items()]}])
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
