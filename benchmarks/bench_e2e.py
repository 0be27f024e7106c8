"""End to end: a GRPO micro-step on a Qwen2.5-1.5B-shaped GPTModel, stock logits against the
processors (one GPU).

The model: 28 layers, hidden 1536, 12 heads in 2 query groups, FFN 8960 (SwiGLU), vocab 151936,
tied embeddings, RMSNorm, RoPE, Megatron Core's local spec, bf16, full activation recomputation,
sequences of 2048. The step: forward, a clipped-ratio policy loss (token mean) over the sampled
tokens, backward. Three ways:

* ``stock``: the model's logits, float32 ``log_softmax``, the selected log-probs, the loss in torch;
* ``logprob-entropy``: ``LogprobEntropyProcessor`` through the hook, the loss in torch;
* ``policy-loss``: ``PolicyLossProcessor`` (the loss fused with the output layer).

For 8k, 16k, 32k and 64k tokens per micro-batch: the median step time, the peak memory, whether it
fits, and (where stock fits) the loss and the output weight's gradient against ``policy-loss``.
Usage (on the GPU machine, Megatron Core carried): ``python benchmarks/bench_e2e.py [--tokens 8192
16384 ...] [--steps 3] [--json FILE]``.
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


def build_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mcore_hooks import hooked_class

    config = TransformerConfig(
        num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2,
        ffn_hidden_size=8960, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, add_qkv_bias=True, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1, layernorm_epsilon=1e-6,
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
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        grad = model.embedding.word_embeddings.weight.grad.float().clone()
        return dict(method=method, tokens=tokens, fits=True, ms=statistics.median(times),
                    peak_extra_mib=round(peak), loss=float(loss), grad=grad)
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return dict(method=method, tokens=tokens, fits=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeat", action="store_true", help="run policy-loss twice (run-to-run noise)")
    args = parser.parse_args()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    model = build_model()
    rows = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, full recompute, seq {SEQ}")
    print("| tokens | method | ms | peak extra MiB | loss | loss vs policy-loss | output-weight grad vs policy-loss | vs stock |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        results = {m: measure(model, m, tokens, args.steps) for m in ("policy-loss", "logprob-entropy", "stock")}
        if args.repeat:  # the same step again: run-to-run (a bitwise-stable path gives 0)
            results["policy-loss (again)"] = measure(model, "policy-loss", tokens, args.steps)
        ref = results["policy-loss"]
        for m, r in results.items():
            if not r["fits"]:
                print(f"| {tokens} | {m} | out of memory | | | | |")
                rows.append({k: v for k, v in r.items()})
                continue
            dl = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30) if ref["fits"] else float("nan")
            dg = float((r["grad"] - ref["grad"]).norm() / ref["grad"].norm()) if ref["fits"] else float("nan")
            st = results["stock"]
            ds = float((r["grad"] - st["grad"]).norm() / st["grad"].norm()) if st["fits"] else float("nan")
            print(f"| {tokens} | {m} | {r['ms']:.1f} | {r['peak_extra_mib']} | {r['loss']:.6f} | {dl:.1e} | {dg:.1e} | {ds:.1e} |")
            rows.append({k: v for k, v in r.items() if k != "grad"} | {"loss_rel": dl, "grad_rel": dg, "grad_rel_stock": ds})
        del results, ref  # the gradients' copies
        sys.stdout.flush()
    fits = {m: max([r["tokens"] for r in rows if r["method"].startswith(m) and r["fits"]], default=0)
            for m in ("stock", "logprob-entropy", "policy-loss")}
    print("largest micro-batch that fits (tokens, of those tried):", fits)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "largest": fits}, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
