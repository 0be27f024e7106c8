"""Peak memory through the processors (the hook's keywords, the ``main_grad`` hand-off), against
the kernels called directly on the same tensors, on one GPU:

    python benchmarks/bench_memory.py [--tokens 8192] [--hidden 4096] [--vocab 151936]

For each processor, forward + backward of a scalar of its outputs, bf16, Triton backend:
``main_grad`` off (the weight's gradient in ``.grad``) and on (``gradient_accumulation_fusion``,
a float32 ``main_grad`` and Megatron DDP's hook after accumulation, as ``tests/ddp_like.py``),
plus the main head with two MTP depths routing the same weight. Reports the peak allocated
beyond what exists before the call (hidden states, weight, ``main_grad``), in MiB, and the
``[V, h]`` placeholder's share. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import types

import torch


def ddp_like(weight: torch.Tensor) -> torch.utils.hooks.RemovableHandle:
    """Megatron DDP's view of the weight: main_grad, its flag, the hook after accumulation."""
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    weight.grad_added_to_main_grad = False

    def hook(param):
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
        param.grad = None

    return weight.register_post_accumulate_grad_hook(hook)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()

    from mcore_hooks import LinearCEProcessor, LogprobEntropyProcessor, PolicyLossProcessor
    from mcore_hooks.kernels import linear_logprob_entropy, linear_policy_loss
    from mcore_hooks.mtp import MTPDepth, fused_mtp_loss
    from mcore_hooks.testing import hook_keywords

    n, h, v = args.tokens, args.hidden, args.vocab
    b, s = 2, n // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    layer = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden0 = torch.randn(s, b, h, device="cuda", generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)
    ctx = {"old_logprobs": -torch.rand(b, s, device="cuda", generator=g) * 3,
           "advantages": torch.randn(b, s, device="cuda", generator=g)}
    placeholder_mib = v * h * 2 / 2**20

    def through(processor, main_grad: bool, depths: int = 0):
        def run():
            hidden = hidden0.detach().clone().requires_grad_()
            kw = hook_keywords(hidden, layer, labels=labels,
                               context=ctx if isinstance(processor, PolicyLossProcessor) else None)
            kw["config"] = types.SimpleNamespace(context_parallel_size=1,
                                                 gradient_accumulation_fusion=main_grad)
            out = processor(**kw)
            if torch.is_tensor(out):
                loss = out.sum()
            else:
                loss = out["loss"] if "loss" in out else out["logprobs"].sum() + out["entropy"].sum()
            for d in range(depths):
                depth = MTPDepth(hidden, labels, layer.weight, layer, 1.0, 0, 1, kw["config"], None, 0, 1, d, False)
                loss = loss + fused_mtp_loss(depth).loss.sum()
            loss.backward()
            del hidden, out, loss
        return run

    def kernel(which, main_grad: bool):
        def run():
            x = hidden0.detach().clone().reshape(-1, h).requires_grad_()
            y = labels.t().reshape(-1)
            extra = dict(weight_grad_accumulator=layer.weight.main_grad) if main_grad else {}
            if which == "policy":
                loss = linear_policy_loss(x, layer.weight, y, token_weight=torch.full((n,), 1.0 / n, device="cuda"),
                                          inputs={k: t.t().reshape(-1) for k, t in ctx.items()}, **extra).loss
            else:
                r = linear_logprob_entropy(x, layer.weight, y, **extra)
                loss = r.logprob.sum() + r.entropy.sum()
            loss.backward()
            del x, loss
        return run

    rows = []
    for main_grad in (False, True):
        handle = ddp_like(layer.weight) if main_grad else None
        cases = [
            ("LogprobEntropyProcessor", through(LogprobEntropyProcessor(), main_grad)),
            ("  kernel linear_logprob_entropy", kernel("logprob", main_grad)),
            ("PolicyLossProcessor", through(PolicyLossProcessor(), main_grad)),
            ("  kernel linear_policy_loss", kernel("policy", main_grad)),
            ("LinearCEProcessor(sum)", through(LinearCEProcessor(reduction="sum"), main_grad)),
            ("LinearCEProcessor(sum) + 2 MTP depths", through(LinearCEProcessor(reduction="sum"), main_grad, depths=2)),
        ]
        for name, fn in cases:
            fn()  # warm-up (Triton compilation, cuBLAS workspaces)
            layer.weight.grad = None
            rows.append((name, "on" if main_grad else "off", peak_mib(fn)))
            layer.weight.grad = None
        if handle is not None:
            handle.remove()
            del layer.weight.main_grad, layer.weight.grad_added_to_main_grad

    print(f"{datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__}; "
          f"{n} tokens x {h} hidden x {v} vocab, bf16; [V, h] bf16 = {placeholder_mib:.0f} MiB")
    print("| path | main_grad | peak beyond inputs (MiB) |\n|---|---|---|")
    for name, mg, mib in rows:
        print(f"| {name.strip()}{' (direct)' if name.startswith('  ') else ''} | {mg} | {mib:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
