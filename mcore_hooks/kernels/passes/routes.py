"""The entry points' routes where they have more than one: a fused loss's passes
(:func:`_fused`: the custom op forming the gradients in the forward, a Python function's loss
through :class:`~.loss_op.LinearFusedLoss`, or the log-prob pass and the per-token terms), and a
call with no tokens (:func:`_no_tokens`, :func:`_zero_anchor`). The entry points
(:mod:`mcore_hooks.kernels`) take them after their arguments' checks."""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch

from . import loss_op, stats_op
from ..common.autograd import TokenLoss
from ..common.dispatch import call
from ..common.losses import PolicyLoss
from ..common.options import KernelParams, LogprobEntropy


def _zero_anchor(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A float32 scalar 0 of a call with no tokens, differentiable in ``hidden`` (``[0, H]``) and
    ``weight``: their gradients are zeros, and the weight's hooks (Megatron DDP's, the
    ``main_grad`` hand-off's) run as after any call, none waiting for a gradient that never
    comes."""
    return hidden.sum(dtype=torch.float32) + weight[:0].sum(dtype=torch.float32)


def _no_tokens(hidden: torch.Tensor, weight: torch.Tensor, with_labels: bool,
               k: Optional[int], kept: bool) -> LogprobEntropy:
    """:class:`LogprobEntropy` of a call with no tokens: empty, differentiable (zero gradients)."""
    anchor = _zero_anchor(hidden, weight)
    empty = anchor.expand(0)
    selected = None if k is None else anchor.expand(0, k)
    none = torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return LogprobEntropy(empty if with_labels else None, empty, empty.detach(),
                          none if with_labels else None, selected, none if kept else None)


def _fused(hidden, weight, p: KernelParams, token_weight: torch.Tensor,
           loss: Union[PolicyLoss, TokenLoss, None], inputs: Mapping[str, torch.Tensor]):
    """(loss, logprob, entropy) of the weighted NLL (``loss`` None), a :class:`PolicyLoss` with
    its ``inputs``, or a bound :class:`TokenLoss`. Gradients formed in the forward where any is
    needed and the backend forms them there at this hidden size
    (:func:`~.loss_op.forms_gradients_in_forward`; with a weight-gradient accumulator and no
    declared upstream gradient, which scales what is added into it, the backward adds the
    float32 dW into it), or an upstream gradient is declared; otherwise the log-prob pass and
    the terms, the logits recomputed in the backward; without gradients, the log-prob pass
    alone.
    The NLL and :class:`PolicyLoss` run as custom ops; a Python function's loss through
    :class:`~.loss_op.LinearFusedLoss`, or autograd over its terms."""
    if p.n == 0:  # an empty micro-batch or shard: a zero loss, zero gradients
        anchor = _zero_anchor(hidden, weight)
        return anchor, anchor.detach().expand(0), anchor.detach().expand(0)
    need_x = hidden.requires_grad and torch.is_grad_enabled()
    need_w = weight.requires_grad and torch.is_grad_enabled()
    as_data = loss is None or type(loss) is PolicyLoss
    if p.upstream_grad is not None and p.weight_grad_accumulator is not None:
        in_forward = True  # declared: the caller asked for the weight's gradient in the forward
    else:  # an accumulator takes the op's float32 dW in its backward (not a Python loss's)
        in_forward = ((p.weight_grad_accumulator is None or as_data)
                      and loss_op.forms_gradients_in_forward(p.backend, hidden.shape[1]))
    names = () if loss is None or not as_data else loss.input_names
    if (need_x or need_w) and in_forward and as_data:
        return loss_op.fused_loss(hidden, weight, p, token_weight, loss, [inputs[k] for k in names],
                              need_x, need_w)
    if (need_x or need_w) and in_forward:
        return loss_op.LinearFusedLoss.apply(hidden, weight, p, loss, need_x, need_w)[:3]
    logprob, entropy, _, _ = stats_op.stats(hidden, weight, p)
    if as_data:
        data = None if loss is None else loss_op.policy_loss_data(loss)
        terms = call(loss_op.token_terms, logprob, entropy, p.valid, token_weight, data,
                     [inputs[k] for k in names], p.backend)[0]
        needs_entropy = loss is not None and loss.needs_entropy
    else:
        needs_entropy = loss.needs_entropy
        ent = entropy if needs_entropy else None
        terms = torch.where(p.valid, loss.terms(slice(0, p.n), logprob, ent), 0.0)
    return (terms.sum(), logprob.detach(),
            entropy.detach() if needs_entropy else torch.zeros_like(logprob))
