"""Loss processors, the loss fused with the output layer: linear cross-entropy and policy losses;
and the ``upstream_grad`` to declare under Megatron's schedules."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch

from .. import compat
from ..debug import check_values
from ..kernels import (
    PolicyLoss,
    aggregation_weights,
    check_upstream_grad_option,
    linear_cross_entropy,
    linear_policy_loss,
    per_token_loss,
)
from ..kernels.common.losses import AGGREGATIONS
from ..postprocess import PostprocessContext
from .labels import is_thd, sequence_index
from .fused import (
    KeptSet,
    _check_flag,
    _check_kept_set,
    _cp_group,
    _declared,
    _FusedProcessor,
    _whole_value,
)


class LinearCEProcessor(_FusedProcessor):
    """Cross-entropy of the labels, fused with the output layer.

    ``reduction="none"``: float32 ``[b, s]``, equal to the stock per-token loss (0 at
    ``ignore_index``). ``"sum"`` / ``"mean"``: a float32 scalar over the positions whose label is
    not ignored, weighted by ``loss_mask`` when the model got one; ``"mean"`` divides by the
    weights' sum, at least 1, as Megatron's schedules divide a micro-batch's loss by its token
    count ("protect against division by zero when all tokens are masked", 0.14+): a micro-batch
    with no position counted gives 0 and no gradient. Under context parallelism the value is the
    whole sequence's (sum and count all-reduced over the CP group, as Megatron's masked mean),
    on every CP rank, while each rank's gradient is its own tokens' share: summed over the CP
    group, the gradients are the unsplit run's.

    The reduced losses take :func:`~mcore_hooks.kernels.linear_cross_entropy`: their gradients
    are formed during the forward (three matmuls instead of four), and the forward holds float32
    gradients for the hidden states and the output weight until the backward.

    Args:
        reduction: ``"none"``, ``"sum"`` or ``"mean"``.
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only where
            fixed blocks or padding remain: the torch backend, a recomputed truncation, kept
            sets and wide id sets, and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
        upstream_grad: the reduced loss's gradient in the backward, declared where the output
            weight's gradient goes into Megatron's ``main_grad``: as
            :class:`PolicyLossProcessor`'s.
    """

    def __init__(
        self,
        *,
        reduction: Literal["none", "sum", "mean"] = "none",
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        upstream_grad: Optional[float] = None,
    ) -> None:
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        check_upstream_grad_option(upstream_grad)
        self.reduction = reduction
        self.upstream_grad = upstream_grad

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        if self.reduction == "none":
            r, bs, _ = self.compute(ctx)
            return self.to_bs(-r.logprob, bs)
        k = self.kernel_inputs(ctx)
        mode = "token-mean" if self.reduction == "mean" else "token-sum"
        token_weight = aggregation_weights(self.counted(ctx, k), mode, group=_cp_group(ctx))
        loss = linear_cross_entropy(k.hidden, k.weight, k.labels, token_weight=token_weight,
                                    **_declared(k.kwargs, self.upstream_grad))
        return _whole_value(loss, ctx)


class PolicyLossProcessor(_FusedProcessor):
    """A PPO / GRPO policy loss fused with the output layer: no ``[tokens, vocab]`` logits, the
    gradients formed in the forward (:func:`~mcore_hooks.kernels.linear_policy_loss`: three
    matmuls where the log-prob path followed by the loss takes four).

    The labels are the sampled tokens (``labels``, or derived from ``input_ids``). The per-token
    inputs the loss takes (for :class:`~mcore_hooks.kernels.PolicyLoss`: ``old_logprobs``,
    ``advantages`` and, with a KL term, ``ref_logprobs``) come as float ``[b, s]`` tensors in a
    mapping passed as ``output_processor_context`` (override :meth:`policy_inputs` to take them
    from elsewhere); ``advantages`` may also be one per sequence (GRPO's), ``[b]``, or one per
    packed sequence with packed THD input, spread over the sequence's tokens (this rank's under
    context parallelism): the same loss and gradients as its ``[b, s]`` broadcast
    (:meth:`sequence_inputs` names the inputs that may). The tokens that count are those whose
    label is not ``ignore_index``, times ``loss_mask`` when the model got one. Aggregation as
    verl's ``agg_loss``: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean`` (a sequence is a row of the batch, or a packed sequence of THD
    input).

    Under context parallelism the value is the whole sequences' on every CP rank (counts summed
    over the CP group) and each rank's gradient its own tokens' share, as
    :class:`LinearCEProcessor`'s.

    Returns ``{"loss": scalar, "logprobs": [b, s], "entropy": [b, s]}`` (detached log-probs and
    entropies for metrics; entropies are 0 unless the loss uses them), or with
    ``as_tuple=True`` the tuple ``(loss, logprobs, entropy)``.

    Objectives that couple the tokens of a sequence (GSPO's sequence-level ratio) are not
    per-token: use :class:`LogprobEntropyProcessor` and the loss in torch (the docs show it).

    Args:
        loss: a :class:`~mcore_hooks.kernels.PolicyLoss`, or a per-token function
            ``fn(logprob, entropy, **inputs)`` in plain torch (differentiated by autograd; see
            :func:`~mcore_hooks.kernels.per_token_loss`).
        aggregation: how the per-token terms make the loss (see above).
        as_tuple: return the tuple instead of the dict.
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id).
        chunk_size: tokens per chunk (None: the backend's default budget).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only where
            fixed blocks or padding remain: the torch backend, a recomputed truncation, kept
            sets and wide id sets, and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`). The gradient: where a token's
            weight does not follow the batch (``"token-sum"``); a mean divides every token's
            gradient by the call's count.
        upstream_grad: where the output weight's gradient goes into Megatron's ``main_grad``
            (``gradient_accumulation_fusion``), the gradient the returned loss will receive in
            the backward, declared so that ``upstream_grad * dW`` goes into ``main_grad`` in the
            forward (6NHV at every hidden size) and no float32 ``[V/tp, h]`` dW is held until
            the backward: under Megatron's schedules,
            :func:`megatron_upstream_grad` (``cp_size / num_microbatches`` for a ``loss_func``
            returning ``(loss, logging)`` with bf16). Checked in the backward on the device: a
            different gradient stops the process with a device-side assertion. The forward
            then adds into ``main_grad``: one backward per forward; refused in a recomputed
            (activation-checkpointed) forward. Ignored where the weight's gradient goes to
            ``.grad``, and with a ``kept_set`` (no vocabulary pass to save: the gradients are
            formed in the backward).
        kept_set: None, ``"replay"`` (the rollout's sampling mask, from
            ``output_processor_context["sampling_mask"]`` beside the loss' inputs) or a
            :class:`~mcore_hooks.kernels.Truncation`: the log-probs (and entropies) the loss
            takes are renormalised over the kept set, so the ratio is against the rollout's
            ``processed_logprobs``. Only the kept logits are made (no vocabulary pass with
            ``"replay"``).
    """

    def __init__(
        self,
        *,
        loss: Any = None,
        aggregation: str = "token-mean",
        as_tuple: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        upstream_grad: Optional[float] = None,
        kept_set: KeptSet = None,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {', '.join(map(repr, AGGREGATIONS))}, got {aggregation!r}"
            )
        _check_flag("as_tuple", as_tuple)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        check_upstream_grad_option(upstream_grad)
        self.loss = per_token_loss(PolicyLoss() if loss is None else loss)
        _check_kept_set(kept_set)
        self.aggregation = aggregation
        self.as_tuple = as_tuple
        self.upstream_grad = upstream_grad
        self.kept_set = kept_set

    def policy_inputs(self, ctx: PostprocessContext) -> dict:
        """The loss' inputs by name, float ``[b, s]`` (or ``[b]``, for :meth:`sequence_inputs`):
        ``output_processor_context``."""
        inputs = ctx.context
        if not isinstance(inputs, dict) and not hasattr(inputs, "items"):
            raise ValueError(
                "output_processor_context: expected a mapping of the loss' per-token inputs "
                "(e.g. {'old_logprobs': ..., 'advantages': ...}, each [b, s]), got "
                f"{type(inputs).__name__}"
            )
        return dict(inputs.items())

    def sequence_inputs(self) -> tuple[str, ...]:
        """The inputs that may come one per sequence, ``[b]`` (one per packed sequence with
        packed THD input), each spread over its sequence's tokens: the loss's
        ``sequence_inputs`` where it has that attribute, else ``("advantages",)`` (GRPO's
        advantages are one per sequence; log-probs are per token), where the loss takes it."""
        names = getattr(self.loss.fn, "sequence_inputs", ("advantages",))
        accepted = self.loss.accepted  # None: a function taking **inputs, any name
        return tuple(n for n in names if accepted is None or n in accepted)

    @staticmethod
    def _per_sequence(name: str, t: torch.Tensor, seq: torch.Tensor, num_sequences: int,
                      ctx: PostprocessContext) -> torch.Tensor:
        """``[num_sequences]`` -> one per token, s-major: each sequence's value at its tokens
        (this rank's under context parallelism; the trailing padding of a packed batch takes the
        last sequence's, as its labels count for nothing), the same tensor a ``[b, s]``
        broadcast gives."""
        if t.shape[0] != num_sequences:
            packed = is_thd(ctx.packed_seq_params) and seq.shape[0] == 1
            per = (f"packed sequence ({num_sequences}, from packed_seq_params.cu_seqlens_q; a packed "
                   "batch is one row, [1, total_tokens])" if packed else f"sample ({num_sequences})")
            raise ValueError(
                f"output_processor_context[{name!r}]: a 1-D tensor is one value per {per}, got "
                f"{t.shape[0]}; or give one per token, [b, s]")
        return t.to(seq.device)[seq.t().reshape(-1)]

    def process(self, ctx: PostprocessContext) -> Union[dict, tuple]:
        k = self.kernel_inputs(ctx)
        b, s = k.bs
        seq, num_sequences = sequence_index(b, s, ctx.packed_seq_params, k.hidden.device, ctx.cp_size)
        token_weight = aggregation_weights(
            self.counted(ctx, k), self.aggregation, sequence_ids=seq.t().reshape(-1),
            num_sequences=num_sequences, group=_cp_group(ctx),
        )
        given = self.policy_inputs(ctx)
        kept = self.kept_kwargs(ctx, k.bs)
        given.pop("sampling_mask", None)  # the kept set, not a loss input
        self.loss.check_inputs(given, "output_processor_context")
        inputs = {}
        per_sequence = self.sequence_inputs()
        for name, t in given.items():
            if isinstance(t, torch.Tensor) and t.dim() == 1 and name in per_sequence:
                inputs[name] = self._per_sequence(name, t, seq, num_sequences, ctx)
                continue
            if not isinstance(t, torch.Tensor) or t.shape != (b, s):
                per = (f"; one per sequence, [{num_sequences}], for "
                       f"{', '.join(map(repr, per_sequence))}" if per_sequence else "")
                raise ValueError(
                    f"output_processor_context[{name!r}]: expected a [b, s] = ({b}, {s}) tensor "
                    f"(one per token{per}), got {tuple(getattr(t, 'shape', ())) or type(t).__name__}"
                )
            inputs[name] = t.t().reshape(-1)  # s-major, like the kernel's tokens
        counts = (token_weight != 0) & (k.labels != self.ignore_index)
        for name, t in inputs.items():  # named as the caller passed them (the kernel says inputs[...])
            if (check_values(counts) and check_values(t)
                    and not bool(torch.isfinite(t.to(counts.device)[counts]).all())):
                raise ValueError(f"output_processor_context[{name!r}]: NaN or infinite values at "
                                 "positions that count (loss_mask and labels)")
        r = linear_policy_loss(k.hidden, k.weight, k.labels, token_weight=token_weight,
                               loss=self.loss, inputs=inputs, **_declared(k.kwargs, self.upstream_grad),
                               **kept)
        loss = _whole_value(r.loss, ctx)
        logprobs, entropy = self.to_bs(r.logprob, k.bs), self.to_bs(r.entropy, k.bs)
        if self.as_tuple:
            return loss, logprobs, entropy
        out = {"loss": loss, "logprobs": logprobs, "entropy": entropy}
        if r.label_outside is not None:
            out["label_outside"] = self.to_bs(r.label_outside, k.bs)
        return out


def megatron_upstream_grad(config: Any, num_microbatches: int, *, loss_func_returns: int = 2) -> float:
    """The ``upstream_grad`` to declare when the loss runs under Megatron Core's schedules
    (``get_forward_backward_func()``), from what the schedule knows: the model's config and the
    ``num_microbatches`` passed to the schedule.

    Megatron's ``forward_step_calc_loss`` scales the loss your ``loss_func`` returns in place
    before the backward (every release 0.13-0.20): ``(loss, logging)`` is multiplied by the
    context-parallel size and divided by ``num_microbatches``; ``(loss, num_tokens, logging)`` is
    left as it is under ``calculate_per_token_loss`` and otherwise divided by ``num_tokens`` (a
    data-dependent value, refused here). The backward seed is the optimizer's loss scale
    (``config.grad_scale_func``; 1 for bf16 and fp32 without a fixed ``loss_scale``). The loss
    function must return the processor's loss itself (not scaled by anything else), and
    ``config.context_parallel_size`` must be the schedule's CP size. The value is float32 in the
    schedule's own order of operations, the gradient bit for bit (the kernels compare with
    ``==``). It reads the optimizer's loss scale from the device (one synchronisation): compute
    it once per step, outside ``forward_step``.

    Args:
        config: the model's ``TransformerConfig``.
        num_microbatches: the schedule's ``num_microbatches`` for this step.
        loss_func_returns: 2 or 3, the length of the tuple ``loss_func`` returns.

    Returns:
        The gradient the returned loss receives in the backward.

    Raises:
        ValueError: it cannot be declared (a 3-tuple without ``calculate_per_token_loss``; fp16,
            whose dynamic loss scale moves): leave ``upstream_grad`` None there.
    """
    return compat.schedule_loss_gradient(config, num_microbatches, loss_func_returns=loss_func_returns)
