"""Fused processors: selected-token log-prob, entropy, both in one pass, and linear cross-entropy.

Each adapts the hook's keywords to :func:`mcore_hooks.kernels.linear_logprob_entropy`: it flattens
``[s, b, h]`` hidden states and ``[b, s]`` labels to tokens, takes the vocab-parallel layout from the
context (TP group, this rank's vocab range, sequence parallelism), folds Megatron's MuP logit scale
into the kernel, and returns float32 ``[b, s]`` like the stock loss. No ``[tokens, vocab]`` logits
are made; the output layer's weight is read directly.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, Optional, Union

import torch

from .. import compat
from ..kernels import (
    BACKENDS,
    LogprobEntropy,
    VocabParallel,
    linear_cross_entropy,
    linear_logprob_entropy,
)
from ..postprocess import PostprocessContext, PostprocessProcessor
from .labels import labels_from_input_ids, per_token_temperature

__all__ = [
    "FusedLogprobProcessor",
    "EntropyProcessor",
    "LogprobEntropyProcessor",
    "LinearCEProcessor",
]


def logit_scale_of(ctx: PostprocessContext) -> float:
    """The constant factor ``ctx.scale_logits`` applies (Megatron's MuP output scaling; 1 without)."""
    probe = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = ctx.scale_logits(probe)
    if out is probe:
        return 1.0
    scale = float(out[0])
    if not math.isclose(float(out[1]), 2.0 * scale, rel_tol=1e-12):
        raise ValueError("scale_logits: the model's logit scaling is not a constant factor")
    return scale


def ensure_output_weight_ready(ctx: PostprocessContext) -> None:
    """Run the output layer's forward pre-hooks if the stock path would have run them.

    Megatron's DDP with the distributed optimizer and ``overlap_param_gather`` waits for a
    module's parameter all-gather in a forward pre-hook. Native hooks (>= 0.18) call the processor
    instead of ``output_layer``, so a processor that reads the weight directly must run them.
    The backport already calls the processor from inside those hooks (after them).
    """
    layer = ctx.output_layer
    if compat.called_from_output_layer_pre_hook():
        return
    for hook in list(getattr(layer, "_forward_pre_hooks", {}).values()):
        hook(layer, (ctx.hidden_states,))


class _KernelInputs(NamedTuple):
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: Optional[torch.Tensor]
    kwargs: dict
    bs: tuple[int, int]
    labels_bs: Optional[torch.Tensor]


class _FusedProcessor(PostprocessProcessor):
    """Shared options and the adaptation from the hook's keywords to the kernel."""

    def __init__(
        self,
        *,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            if not (math.isfinite(temperature) and temperature > 0):
                raise ValueError(f"temperature: expected a positive finite value, got {temperature!r}")
        elif not isinstance(temperature, torch.Tensor):
            raise TypeError(f"temperature: expected a float or tensor, got {type(temperature).__name__}")
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self.backend = backend

    def labels(self, ctx: PostprocessContext) -> torch.Tensor:
        """``ctx.labels``, or next-token labels from ``input_ids`` (per sequence when packed)."""
        if ctx.labels is not None:
            return ctx.labels
        if ctx.input_ids is None:
            raise ValueError("labels: neither labels nor input_ids were passed to the model")
        if ctx.cp_size > 1:
            raise ValueError(
                "labels: must be passed (sharded like input_ids) under context parallelism; "
                "they cannot be derived from this rank's input_ids"
            )
        return labels_from_input_ids(ctx.input_ids, self.ignore_index, ctx.packed_seq_params)

    def kernel_inputs(self, ctx: PostprocessContext, *, with_labels: bool = True) -> "_KernelInputs":
        """The hook's keywords in the kernels' form: ``[tokens, h]`` hidden states (s-major),
        flat labels, keyword arguments, the ``(b, s)`` to reshape per-token results to, and the
        ``[b, s]`` labels used (None without labels)."""
        ensure_output_weight_ready(ctx)
        hidden = ctx.hidden_states
        if hidden.dim() != 3:
            raise ValueError(f"hidden_states: expected [s, b, h], got shape {tuple(hidden.shape)}")
        s_local, b, h = hidden.shape
        s = s_local * ctx.tp_size if ctx.sequence_parallel else s_local
        labels = flat_labels = None
        if with_labels:
            labels = self.labels(ctx)
            if not isinstance(labels, torch.Tensor) or labels.shape != (b, s):
                raise ValueError(
                    f"labels: expected shape ({b}, {s}) to match hidden states [s, b, h] = "
                    f"{tuple(hidden.shape)}{' (sequence parallel)' if ctx.sequence_parallel else ''}, "
                    f"got {tuple(getattr(labels, 'shape', ()))}"
                )
            flat_labels = labels.t().reshape(-1)  # [s*b], s-major like the hidden states
        kwargs = dict(
            temperature=per_token_temperature(self.temperature, b, s, ctx.packed_seq_params),
            logit_scale=logit_scale_of(ctx),
            ignore_index=self.ignore_index,
            parallel=VocabParallel(ctx.tp_group, ctx.vocab_start, ctx.sequence_parallel),
            chunk_size=self.chunk_size,
            backend=self.backend,
        )
        return _KernelInputs(hidden.reshape(-1, h), ctx.weight, flat_labels, kwargs, (b, s), labels)

    def compute(
        self, ctx: PostprocessContext, *, with_labels: bool = True
    ) -> tuple[LogprobEntropy, tuple[int, int], Optional[torch.Tensor]]:
        """Run the log-prob / entropy kernel; returns its per-token results, the ``(b, s)`` to
        reshape them to, and the ``[b, s]`` labels used (None without labels)."""
        k = self.kernel_inputs(ctx, with_labels=with_labels)
        result = linear_logprob_entropy(k.hidden, k.weight, k.labels, **k.kwargs)
        return result, k.bs, k.labels_bs

    @staticmethod
    def to_bs(t: torch.Tensor, bs: tuple[int, int]) -> torch.Tensor:
        b, s = bs
        return t.view(s, b).t().contiguous()


class FusedLogprobProcessor(_FusedProcessor):
    """Log-probability of each label, float32 ``[b, s]`` (``-`` the stock per-token loss)."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        r, bs, _ = self.compute(ctx)
        return self.to_bs(r.logprob, bs)


class EntropyProcessor(_FusedProcessor):
    """Entropy of each token's distribution, float32 ``[b, s]``; needs no labels.

    Positions whose label is ``ignore_index`` give 0 when labels are passed (or derived with
    ``mask_from_labels=True``); otherwise every position is computed.
    """

    def __init__(self, *, mask_from_labels: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mask_from_labels = mask_from_labels

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        with_labels = ctx.labels is not None or self.mask_from_labels
        r, bs, _ = self.compute(ctx, with_labels=with_labels)
        return self.to_bs(r.entropy, bs)


class LogprobEntropyProcessor(_FusedProcessor):
    """Log-prob and entropy from one pass over the vocabulary (one matmul, not two).

    Returns ``{"logprobs": [b, s], "entropy": [b, s]}``, or with ``as_tuple=True`` the tuple
    ``(logprobs, entropy)`` that the combined-1F1B schedule plan accepts.
    """

    def __init__(self, *, as_tuple: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.as_tuple = as_tuple

    def process(self, ctx: PostprocessContext) -> Union[dict, tuple]:
        r, bs, _ = self.compute(ctx)
        logprobs, entropy = self.to_bs(r.logprob, bs), self.to_bs(r.entropy, bs)
        return (logprobs, entropy) if self.as_tuple else {"logprobs": logprobs, "entropy": entropy}


class LinearCEProcessor(_FusedProcessor):
    """Cross-entropy of the labels, fused with the output layer.

    ``reduction="none"``: float32 ``[b, s]``, equal to the stock per-token loss (0 at
    ``ignore_index``). ``"sum"`` / ``"mean"``: a scalar over positions where ``loss_mask`` (if the
    model got one) is nonzero and the label is not ignored, weighted by the mask; ``"mean"``
    divides by the mask's sum. The reduced losses take
    :func:`~mcore_hooks.kernels.linear_cross_entropy`: their gradients are formed during the
    forward (three matmuls instead of four), and the forward holds float32 gradients for the
    hidden states and the output weight until the backward.
    """

    def __init__(self, *, reduction: Literal["none", "sum", "mean"] = "none", **kwargs: Any) -> None:
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
        super().__init__(**kwargs)
        self.reduction = reduction

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        if self.reduction == "none":
            r, bs, _ = self.compute(ctx)
            return self.to_bs(-r.logprob, bs)
        k = self.kernel_inputs(ctx)
        weight = (k.labels_bs != self.ignore_index).float()
        if ctx.loss_mask is not None:
            weight = weight * ctx.loss_mask.float()
        if self.reduction == "mean":
            weight = weight / weight.sum().clamp(min=1.0)
        token_weight = weight.t().reshape(-1)  # s-major, like the kernel's tokens
        return linear_cross_entropy(k.hidden, k.weight, k.labels, token_weight=token_weight, **k.kwargs)
