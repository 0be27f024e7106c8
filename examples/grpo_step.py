"""A GRPO-style policy update on a tiny Megatron Core GPTModel, on CPU, done twice:
once from the stock logits (what RL frameworks do today: [tokens, vocab] logits, fp32
log-softmax, gather) and once through mcore-hooks processors (no logits materialised).
Both must give the same losses and the same updated weights.

    python examples/grpo_step.py
"""

from __future__ import annotations

import sys

import torch

from mcore_hooks import enable_output_processor
from mcore_hooks.processors import FusedLogprobProcessor, LogprobEntropyProcessor
from mcore_hooks.testing import quiet_megatron

with quiet_megatron():  # Megatron Core's notes about itself on a CPU machine (no TE, no Apex)
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, model_parallel, tiny_batch

CLIP, ENTROPY_COEF, LR, TEMPERATURE = 0.2, 0.01, 0.05, 0.9


# --- the stock way: full logits -------------------------------------------------------------
def stock_logprob_entropy(model, batch):
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    logits = model(**inputs).float() / TEMPERATURE  # [b, s, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


# --- the mcore-hooks way: a processor ---------------------------------------------------------
def hooked_logprob_entropy(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    out = model(**inputs, output_processor=LogprobEntropyProcessor(temperature=TEMPERATURE))
    return out["logprobs"], out["entropy"]


def hooked_old_logprobs(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    return model(**inputs, output_processor=FusedLogprobProcessor(temperature=TEMPERATURE))


def policy_loss(logprobs, old_logprobs, entropy, advantages, mask):
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    denom = mask.sum()
    return (pg * mask).sum() / denom - ENTROPY_COEF * (entropy * mask).sum() / denom


def grpo_step(model, batches, logprob_entropy, old_logprobs_fn):
    """Old log-probs for every mini-batch first (no grad), then one update per mini-batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with torch.no_grad():
        olds = [old_logprobs_fn(model, b) for b in batches]
    losses = []
    for batch, old in zip(batches, olds):
        logprobs, entropy = logprob_entropy(model, batch)
        g = torch.Generator().manual_seed(len(losses))
        advantages = torch.randn(logprobs.shape[0], generator=g)
        loss = policy_loss(logprobs, old, entropy, advantages, batch["loss_mask"].float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    with quiet_megatron(), model_parallel(tp=1):
        cfg = TinyModelConfig(model_class="gpt", tied=True)
        stock = build_tiny_model(cfg)
        hooked = enable_output_processor(build_tiny_model(cfg))  # same seed: same weights
        batches = [tiny_batch(cfg, seed=i) for i in range(2)]

        losses_stock = grpo_step(stock, batches, stock_logprob_entropy, lambda m, b: stock_logprob_entropy(m, b)[0])
        losses_hooked = grpo_step(hooked, batches, hooked_logprob_entropy, hooked_old_logprobs)

        max_dw = max(
            (p.detach() - q.detach()).abs().max().item()
            for p, q in zip(stock.parameters(), hooked.parameters())
        )
        moved = max(
            (p.detach() - q.detach()).abs().max().item()
            for p, q in zip(stock.parameters(), build_tiny_model(cfg).parameters())
        )
    # float32 throughout; the two paths sum the same terms in another order (the fused kernel's
    # chunks against one log_softmax), so the losses agree to float32 rounding, not bit for bit
    print("GRPO step on a tiny GPTModel (CPU, float32), two mini-batches")
    same = True
    for i, (a, b) in enumerate(zip(losses_stock, losses_hooked)):
        tol = 1e-5 * max(1.0, abs(a))
        same = same and abs(a - b) <= tol
        print(f"  mini-batch {i}: loss stock logits {a:+.8f}, mcore-hooks processors {b:+.8f}: "
              f"difference {abs(a - b):.1e} (held to {tol:.0e})")
    w_tol = 1e-5 * max(moved, 1e-12) + 1e-7
    same = same and max_dw <= w_tol
    print(f"  weights moved by the update: {moved:.3e}; largest difference between the two updated "
          f"models: {max_dw:.1e} (held to {w_tol:.0e})")
    print("equal within those tolerances" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
