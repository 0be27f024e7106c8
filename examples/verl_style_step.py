"""verl's fused log-prob / entropy path, the mcore-hooks way, on a tiny CPU GPTModel with MTP.

verl gets log-probs and entropies from a Megatron Core model in three ways, one per release and
setting: ``output_processor=fused_output_processor`` on Megatron Core >= 0.18, a replaced
``forward`` below 0.18, and, with MTP on, no fused path at all. This example makes the one call
that replaces all three (``VerlFusedProcessor`` through ``enable_output_processor``) on a packed
(THD) batch as verl builds it, with a per-sequence temperature and two MTP depths, and checks it
against the stock path: log-probs and entropies from the full logits, the MTP losses Megatron
logs, and the gradients of one PPO-style objective.

    python examples/verl_style_step.py
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from mcore_hooks import enable_output_processor
from mcore_hooks.integrations.verl import FusedOutputProcessorContext, VerlFusedProcessor
from mcore_hooks.testing import quiet_megatron

with quiet_megatron():  # Megatron Core's notes about itself on a CPU machine (no TE, no Apex)
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, model_parallel, tiny_batch


def mtp_tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
    MTPLossLoggingHelper.tracker.clear()
    return values


def stock_mtp_takes_packed_batches() -> bool:
    """Stock MTP refuses packed sequences before Megatron Core 0.16 (it rolls them whole)."""
    import inspect

    from megatron.core.transformer.multi_token_prediction import roll_tensor

    return "packed_seq_params" in inspect.signature(roll_tensor).parameters


def main() -> int:
    with quiet_megatron(), model_parallel(tp=1):
        cfg = TinyModelConfig(tied=False, mtp_num_layers=2)
        stock = build_tiny_model(cfg).train()
        model = enable_output_processor(build_tiny_model(cfg)).train()  # same seed: same weights
        packed = stock_mtp_takes_packed_batches()
        # verl's batches are packed: [1, T] with packed_seq_params (one row per sample otherwise)
        batch = tiny_batch(cfg, packed=packed, batch_size=3)
        temperature = torch.tensor([0.6, 1.0, 1.4])  # one per sample (per packed sequence)
        advantages = torch.randn(batch["labels"].numel(), generator=torch.Generator().manual_seed(0))

        # verl, the mcore-hooks way: the same call on every release, MTP included.
        out = model(**batch, output_processor=VerlFusedProcessor(),
                    output_processor_context=FusedOutputProcessorContext(temperature=temperature))
        ours_mtp = mtp_tracker()
        (-(out.log_probs * advantages).sum() - 0.01 * out.entropy.sum()).backward()

        # the stock path: full logits, divided by the temperature, log-softmax. The logits come
        # from a copy without MTP sharing the stock model's layers (a stock forward with MTP
        # computes the MTP losses only together with the main loss, and needs labels for it).
        ref = build_tiny_model(dataclasses.replace(cfg, mtp_num_layers=0))
        ref.embedding, ref.decoder, ref.output_layer = stock.embedding, stock.decoder, stock.output_layer
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
        if packed:
            lengths = batch["packed_seq_params"].cu_seqlens_q.diff().long()
            per_token = temperature.repeat_interleave(lengths).view(1, -1, 1)
        else:
            per_token = temperature.view(-1, 1, 1)
        logits = ref(**inputs).float() / per_token
        stock_mtp_loss = stock(**batch)  # the loss call runs (and logs) stock MTP
        stock_mtp = mtp_tracker()
        logp = torch.log_softmax(logits, -1)
        log_probs = logp.gather(-1, batch["labels"].unsqueeze(-1)).view(-1)
        entropy = -(logp.exp() * logp).sum(-1).view(-1)
        (-(log_probs * advantages).sum() - 0.01 * entropy.sum() + 0 * stock_mtp_loss.sum()).backward()

        grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), stock.parameters())
                 if p.grad is not None]
        d_lp = (out.log_probs - log_probs).abs().max().item()
        d_ent = (out.entropy - entropy).abs().max().item()
        # each logged value against its own size (losses, token counts)
        d_mtp = max((ours_mtp[k] - stock_mtp[k]).abs().max().item()
                    / max(stock_mtp[k].abs().max().item(), 1.0) for k in stock_mtp)
        d_grad = max(((a - b).norm() / b.norm()).item() for _, a, b in grads)
        # The bounds. Both paths run the same float32 operations, in other orders: the fused
        # head's, and the CPU BLAS's blocking, which may follow the operands' alignment from run
        # to run. Two orders of a sum of K float32 terms differ by at most about K * eps times
        # the sum of the terms' magnitudes. The widest sums here are the MLP's (K = 4 x hidden);
        # a value passes through 5 such products a layer (qkv, attention, projection, fc1, fc2),
        # each normalised after, and the output layer's: the log-probs through the 2 layers,
        # the MTP losses through the MTP depths too, the gradients back again.
        per_product = 4 * cfg.hidden_size * torch.finfo(torch.float32).eps
        main = 5 * cfg.num_layers + 1
        with_mtp = main + 5 * cfg.mtp_num_layers
        logit_scale = logits.abs().max().item()  # the log-probs' and entropies' terms
        tol_lp = main * per_product * logit_scale
        tol_mtp = with_mtp * per_product
        tol_grad = 2 * with_mtp * per_product
    layout = "packed batch" if packed else "unpacked batch (this release's stock MTP takes no packing)"
    print(f"verl-style step on a tiny GPTModel with 2 MTP depths, {layout}, per-sample temperature")
    print(f"  log-probs {d_lp:.1e}, entropies {d_ent:.1e} from stock (held to {tol_lp:.0e}); logged MTP "
          f"values (relative) {d_mtp:.1e} ({tol_mtp:.0e}); gradients (relative) {d_grad:.1e} ({tol_grad:.0e})")
    same = d_lp <= tol_lp and d_ent <= tol_lp and d_mtp <= tol_mtp and d_grad <= tol_grad
    print("same as the stock path" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
