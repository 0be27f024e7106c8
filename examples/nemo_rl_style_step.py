"""NeMo RL's fused log-prob path, the mcore-hooks way, on a tiny CPU GPTModel.

NeMo RL patches ``GPTModel.forward`` for the whole class
(``patch_gpt_model_forward_for_linear_ce_fusion``), calls the model with ``labels=input_ids`` and
gets float32 ``[B, S-1]`` log-probs of ``input_ids[:, 1:]``, which its training loop then divides
by the sampling temperature. This example does a clipped-ratio policy step the same way through
``NemoRLLogprobProcessor`` (one model instance hooked, nothing patched; the temperature divides
the logits) and through the stock logits, and checks that the two steps agree: the old
log-probs, the loss and the updated weights.

    python examples/nemo_rl_style_step.py
"""

from __future__ import annotations

import sys

import torch

from mcore_hooks import enable_output_processor
from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
from mcore_hooks.testing import quiet_megatron

with quiet_megatron():  # Megatron Core's notes about itself on a CPU machine (no TE, no Apex)
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, model_parallel, tiny_batch

TEMPERATURE, CLIP, LR = 0.8, 0.2, 0.05


def stock_logprobs(model, batch):
    """[B, S-1]: the stock logits, divided by the temperature, log-softmax, next token."""
    logits = model(**batch).float() / TEMPERATURE
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def fused_logprobs(model, batch):
    """[B, S-1] as NeMo RL's fused forward returns them, with labels=input_ids."""
    return model(**batch, labels=batch["input_ids"],
                 output_processor=NemoRLLogprobProcessor(temperature=TEMPERATURE))


def policy_step(model, batch, logprobs_fn, advantages, mask):
    with torch.no_grad():
        old = logprobs_fn(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logprobs = logprobs_fn(model, batch)
    ratio = torch.exp(logprobs - old)
    adv = advantages.unsqueeze(1)
    loss = -(torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv) * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return old, loss.item()


def main() -> int:
    with quiet_megatron(), model_parallel(tp=1):
        cfg = TinyModelConfig(tied=True)
        stock = build_tiny_model(cfg)
        model = enable_output_processor(build_tiny_model(cfg))  # same seed: same weights
        batch = {k: v for k, v in tiny_batch(cfg, batch_size=3).items() if k not in ("labels", "loss_mask")}
        advantages = torch.randn(3, generator=torch.Generator().manual_seed(0))
        mask = torch.ones(3, batch["input_ids"].shape[1] - 1)
        before = [p.detach().clone() for p in stock.parameters()]
        old_stock, loss_stock = policy_step(stock, batch, stock_logprobs, advantages, mask)
        old_fused, loss_fused = policy_step(model, batch, fused_logprobs, advantages, mask)
        d_old = (old_stock - old_fused).abs().max().item()
        d_w = max((p - q).abs().max().item() for p, q in zip(stock.parameters(), model.parameters()))
        moved = max((p - q).abs().max().item() for p, q in zip(stock.parameters(), before))
    # The bounds. Both paths run the same float32 operations in other orders (the fused head's,
    # the CPU BLAS's blocking). Two orders of a sum of K float32 terms differ by at most about
    # K * eps times the sum of the terms' magnitudes; the widest sums are the MLP's (K = 4 x
    # hidden), 5 products a layer and the output layer's: the log-probs (terms of the size of
    # the log-probs themselves, at least 1), the loss (theirs times the advantages), the
    # weights' step (its gradient's error, back through the same products, times its size).
    products = 5 * cfg.num_layers + 1
    per_product = 4 * cfg.hidden_size * torch.finfo(torch.float32).eps
    tol_old = products * per_product * max(old_stock.abs().max().item(), 1.0)
    tol_loss = tol_old * max(advantages.abs().max().item(), 1.0)
    tol_w = 2 * products * per_product * moved
    print(f"NeMo RL-style step on a tiny GPTModel: old log-probs [B, S-1] {tuple(old_fused.shape)}")
    print(f"  old log-probs {d_old:.1e} from stock (held to {tol_old:.0e}); loss stock {loss_stock:+.8f} "
          f"fused {loss_fused:+.8f} ({tol_loss:.0e}); updated weights {d_w:.1e} apart ({tol_w:.0e})")
    same = d_old <= tol_old and abs(loss_stock - loss_fused) <= tol_loss and d_w <= tol_w
    print("same as the stock path" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
