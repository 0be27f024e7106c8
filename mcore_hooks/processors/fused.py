"""Fused processors: selected-token log-prob, entropy, both in one pass, and linear cross-entropy.

Each adapts the hook's keywords to :func:`mcore_hooks.kernels.linear_logprob_entropy`: it flattens
``[s, b, h]`` hidden states and ``[b, s]`` labels to tokens, takes the vocab-parallel layout from the
context (TP group, this rank's vocab range, sequence parallelism), folds Megatron's MuP logit scale
into the kernel, and returns float32 ``[b, s]`` like the stock loss. No ``[tokens, vocab]`` logits
are made; the output layer's weight is read directly.

Where the model's config asks for ``gradient_accumulation_fusion`` and the output weight has a
float32 ``main_grad`` (Megatron DDP), the weight's gradient is added into ``main_grad`` in float32
in the backward, and the weight is marked ``grad_added_to_main_grad`` with a placeholder gradient,
as Megatron's own linear layers do: the kernels allocate no ``[V, h]`` gradient, the placeholder
is ``[V/tp, h]`` (Megatron's protocol; DDP's hook drops it at once). The losses whose gradients
are otherwise formed in the forward then form them in the backward (the upstream gradient that
scales them is known only there), unless ``upstream_grad`` declares it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Optional, Union

import torch

from .. import compat, main_grad
from ..debug import check_values
from ..kernels import (
    BACKENDS,
    LogprobEntropy,
    PolicyLoss,
    Truncation,
    VocabParallel,
    aggregation_weights,
    check_upstream_grad_option,
    linear_cross_entropy,
    linear_logprob_entropy,
    linear_policy_loss,
    per_token_loss,
    triton_unavailable,
)
from ..kernels.losses import AGGREGATIONS, group_sum
from ..kernels.options import is_finite
from ..mtp import MTPDepth, MTPLoss, fused_mtp_loss
from ..postprocess import PostprocessContext, PostprocessProcessor
from .labels import labels_from_input_ids, per_request, per_token_temperature, sequence_index

__all__ = [
    "FusedLogprobProcessor",
    "EntropyProcessor",
    "LogprobEntropyProcessor",
    "LinearCEProcessor",
    "PolicyLossProcessor",
    "SelectedLogprobProcessor",
    "TopKDistillationProcessor",
    "megatron_upstream_grad",
]

KeptSet = Union[None, Literal["replay"], Truncation]


def _check_kept_set(kept_set: Any) -> None:
    if not (kept_set is None or isinstance(kept_set, Truncation)
            or isinstance(kept_set, str) and kept_set == "replay"):
        raise ValueError(
            "kept_set: expected None (the full vocabulary), 'replay' (the rollout's sampling mask, "
            "output_processor_context['sampling_mask']) or a Truncation (recomputed), got "
            f"{kept_set!r}")


def _per_token_ids(name: str, t: Any, b: int, s: int) -> torch.Tensor:
    """``[b, s, K]`` integer ids -> ``[s*b, K]`` long, s-major like the kernel's tokens."""
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[:2] != (b, s):
        raise ValueError(
            f"{name}: expected a [b, s, K] = ({b}, {s}, K) integer tensor (K ids per position, -1 "
            f"padding), got {tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    return t.transpose(0, 1).reshape(b * s, t.shape[2])


def _per_token_truncation(t: Truncation, ctx: PostprocessContext, b: int, s: int) -> Truncation:
    """``t`` with each per-request option (one per sample, or per packed sequence) spread over
    this call's tokens, on the hidden states' device; the kept set's width read from the
    per-request top-k on the host, where it was given."""
    def spread(name: str) -> Any:
        value = getattr(t, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        dtype = torch.long if name == "top_k" else torch.float32  # [0, 0] is a float option too
        return per_request(f"kept_set.{name}", torch.as_tensor(value, dtype=dtype), b, s,
                           ctx.packed_seq_params, ctx.cp_size, ctx.hidden_states.device)

    if all(isinstance(getattr(t, f), (int, float)) for f in ("top_k", "top_p", "min_p")):
        return t
    top_k = spread("top_k")
    width = t.max_top_k
    if not isinstance(top_k, int) and width is None:  # the host's copy: no device read
        ks = t.top_k.tolist() if isinstance(t.top_k, torch.Tensor) else list(t.top_k)
        # <= 0 means none: the whole vocabulary (the kernel caps the width at it)
        width = max(int(k) if int(k) > 0 else 1 << 62 for k in ks)
    return dataclasses.replace(t, top_k=top_k, top_p=spread("top_p"), min_p=spread("min_p"),
                               max_top_k=None if isinstance(top_k, int) else width)


def _context_tensor(ctx: PostprocessContext, key: str, what: str) -> Any:
    given = ctx.context
    if not hasattr(given, "__getitem__") or not hasattr(given, "keys") or key not in given.keys():
        raise ValueError(
            f"output_processor_context: expected a mapping with {key!r} ({what}), got "
            f"{type(given).__name__}{' without it' if hasattr(given, 'keys') else ''}")
    return given[key]


class _KernelInputs(NamedTuple):
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: Optional[torch.Tensor]
    kwargs: dict
    bs: tuple[int, int]
    labels_bs: Optional[torch.Tensor]


def _has_key(context: Any, key: str) -> bool:
    return isinstance(context, Mapping) and key in context


def _check_options(temperature: Any, ignore_index: Any, chunk_size: Any, backend: Any) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "triton":
        why = triton_unavailable()
        if why is not None:
            raise ValueError(f"backend: 'triton' cannot run on this machine: {why}; backend='auto' "
                             "takes Triton where it can run and the torch backend elsewhere")
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() != 1 or not temperature.dtype.is_floating_point:
            raise ValueError(
                "temperature: expected a positive float or a 1-D float tensor (one per sample), "
                f"got a {temperature.dtype} tensor of shape {tuple(temperature.shape)}"
            )
        if check_values(temperature) and not bool((torch.isfinite(temperature) & (temperature > 0)).all()):
            raise ValueError("temperature: every value must be positive and finite")
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not (is_finite(temperature) and temperature > 0):
            raise ValueError(f"temperature: expected a positive finite value, got {temperature!r}")
    else:
        raise TypeError(
            f"temperature: expected a positive float or a 1-D float tensor, got {type(temperature).__name__}"
        )
    # Whether it collides with a vocabulary id is checked once the vocabulary size is known.
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index: expected an int (e.g. -100), got {ignore_index!r}")
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")


class _FusedProcessor(PostprocessProcessor):
    """Shared options and the adaptation from the hook's keywords to the kernel."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_FusedProcessor":
        if args:
            raise TypeError(
                f"{cls.__name__}() takes keyword arguments only, e.g. "
                f"{cls.__name__}(temperature=0.7); got {len(args)} positional argument(s)"
            )
        return super().__new__(cls, **kwargs)

    def _set_options(
        self, temperature: Union[float, torch.Tensor], ignore_index: int, chunk_size: Optional[int],
        backend: str, batch_invariant: bool = True,
    ) -> None:
        _check_options(temperature, ignore_index, chunk_size, backend)
        _check_flag("batch_invariant", batch_invariant)
        self.batch_invariant = batch_invariant
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self.backend = backend

    def mtp_loss(self, depth: MTPDepth) -> MTPLoss:
        """The multi-token-prediction depths' loss (:mod:`mcore_hooks.mtp`): the fused
        cross-entropy kernel with this processor's ``backend``, ``chunk_size``,
        ``ignore_index`` and ``batch_invariant``, no temperature (MTP's loss is a training loss), acceptance from the
        same pass. No depth builds ``[tokens, vocab]`` logits."""
        return fused_mtp_loss(
            depth, backend=self.backend, chunk_size=self.chunk_size, ignore_index=self.ignore_index,
            batch_invariant=self.batch_invariant,
        )

    def temperature_for(self, ctx: PostprocessContext) -> Union[float, torch.Tensor]:
        """The temperature of this call: the processor's own (a subclass may take it from the
        call, e.g. from ``ctx.context``)."""
        return self.temperature

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
        if self.kept_set != "replay" and _has_key(ctx.context, "sampling_mask"):
            over = ("the whole vocabulary" if self.kept_set is None
                    else "the truncation it recomputes")
            raise ValueError(
                f"output_processor_context['sampling_mask']: given, but this processor's kept_set is "
                f"{self.kept_set!r}, so its log-probs would be over {over}, not the rollout's kept "
                "set; pass kept_set='replay' to renormalise over the mask (or leave it out)")
        hidden, weight = ctx.output_layer_inputs()
        note = compat.output_layer_precision_note(ctx.config)
        if note is not None:
            warnings.warn(note, stacklevel=2)  # once per call site (Python's default filter)
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"the model's hidden states are {hidden.dtype}: the fused processors take float32, "
                "bfloat16 or float16 models (the model config's params_dtype, bf16, fp16)")
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
            temperature=per_token_temperature(self.temperature_for(ctx), b, s, ctx.packed_seq_params,
                                              ctx.cp_size, hidden.device),
            logit_scale=ctx.logit_scale(),
            ignore_index=self.ignore_index,
            parallel=VocabParallel(ctx.tp_group, ctx.vocab_start, ctx.sequence_parallel),
            chunk_size=self.chunk_size,
            backend=self.backend,
            batch_invariant=self.batch_invariant,
        )
        weight, into_main_grad = main_grad.main_grad_route(weight, ctx.config)  # gradient_accumulation_fusion
        kwargs.update(into_main_grad)
        return _KernelInputs(hidden.reshape(-1, h), weight, flat_labels, kwargs, (b, s), labels)

    kept_set: KeptSet = None

    def sampling_mask(self, ctx: PostprocessContext) -> torch.Tensor:
        """The rollout's kept set for ``kept_set="replay"``: integer ``[b, s, K]`` global ids
        (-1 padding), row ``[i, j]`` the set the token labelled at ``[i, j]`` was sampled from
        (aligned with the labels, sharded like them under context parallelism), taken from
        ``output_processor_context["sampling_mask"]``; override to take it from elsewhere.
        :func:`mcore_hooks.rollout.sampling_mask_ids` turns vLLM's and SGLang's masks into rows."""
        return _context_tensor(ctx, "sampling_mask", "the rollout's sampling mask, [b, s, K] ids")

    def kept_kwargs(self, ctx: PostprocessContext, bs: tuple[int, int]) -> dict:
        """The kernel keywords of this processor's ``kept_set`` (none without one): a
        :class:`~mcore_hooks.kernels.Truncation` with its per-request options spread over the
        tokens, or the sampling mask's rows."""
        if self.kept_set is None:
            return {}
        if isinstance(self.kept_set, Truncation):
            return {"truncation": _per_token_truncation(self.kept_set, ctx, *bs)}
        name = "output_processor_context['sampling_mask']"
        ids = _per_token_ids(name, self.sampling_mask(ctx), *bs)
        v_total = ctx.weight.shape[0] * ctx.tp_size
        if check_values(ids):  # named as the caller passed it (the kernel says kept_ids)
            bad = (ids < -1) | (ids >= v_total)
            if bool(bad.any()):
                raise ValueError(f"{name}: ids must be vocabulary ids in [0, {v_total}) or -1 "
                                 f"(padding), got {int(ids[bad][0])}")
        return {"kept_ids": ids}

    def compute(
        self, ctx: PostprocessContext, *, with_labels: bool = True
    ) -> tuple[LogprobEntropy, tuple[int, int], Optional[torch.Tensor]]:
        """Run the log-prob / entropy kernel; returns its per-token results, the ``(b, s)`` to
        reshape them to, and the ``[b, s]`` labels used (None without labels)."""
        k = self.kernel_inputs(ctx, with_labels=with_labels)
        kept = self.kept_kwargs(ctx, k.bs)
        result = linear_logprob_entropy(k.hidden, k.weight, k.labels, **k.kwargs, **kept)
        if "kept_ids" in kept and ctx.loss_mask is not None:
            result = self._refuse_empty_rows(ctx, k, kept["kept_ids"], result)
        return result, k.bs, k.labels_bs

    def _refuse_empty_rows(self, ctx: PostprocessContext, k: "_KernelInputs", ids: torch.Tensor,
                           result: LogprobEntropy) -> LogprobEntropy:
        """A position the loss mask counts was sampled, so its replayed row cannot be empty (a
        mask short or shifted against the labels): refused where values are checked, else NaN
        there (an empty row alone gives 0: a prompt or padding position)."""
        empty = (self.counted(ctx, k) != 0) & ~(ids.to(k.hidden.device) >= 0).any(dim=1)
        if check_values(empty) and bool(empty.any()):
            b, s = k.bs
            i = int(empty.nonzero()[0])
            raise ValueError(
                f"output_processor_context['sampling_mask']: position ({i % b}, {i // b}) counts "
                f"(loss_mask) but its kept set is empty (all -1): the mask is short or shifted "
                f"against the labels ({int(empty.sum())} position(s))")
        return result._replace(logprob=torch.where(empty, torch.nan, result.logprob),
                               entropy=torch.where(empty, torch.nan, result.entropy))

    def counted(self, ctx: PostprocessContext, k: "_KernelInputs") -> torch.Tensor:
        """Float32 per-token weights of the positions that count (s-major, like the kernel's
        tokens): the label is not ``ignore_index``, times ``loss_mask`` when the model got one."""
        mask = (k.labels_bs != self.ignore_index).float()
        if ctx.loss_mask is not None:
            lm = ctx.loss_mask
            if not isinstance(lm, torch.Tensor) or lm.shape != k.labels_bs.shape:
                raise ValueError(
                    f"loss_mask: expected shape {tuple(k.labels_bs.shape)} (the labels' [b, s]), got "
                    f"{tuple(getattr(lm, 'shape', ())) or type(lm).__name__}"
                )
            mask = mask * lm.float()
        return mask.t().reshape(-1)

    @staticmethod
    def to_bs(t: torch.Tensor, bs: tuple[int, int]) -> torch.Tensor:
        b, s = bs
        # a copy, never a view: at b = 1 the transpose is contiguous already, and the kernels
        # save their per-token outputs for the backward (an in-place edit would corrupt it)
        return t.view(s, b).t().clone(memory_format=torch.contiguous_format)


class FusedLogprobProcessor(_FusedProcessor):
    """Log-probability of each label, float32 ``[b, s]`` (``-`` the stock per-token loss).

    Labels are the model's ``labels``, or next-token labels derived from ``input_ids`` (per
    sequence when packed). Under the combined-1F1B schedule plan the result is a tensor already.

    Args:
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only on the
            torch backend and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
        kept_set: None (the full vocabulary), ``"replay"`` (renormalise over the rollout's
            sampling mask, :meth:`sampling_mask`) or a
            :class:`~mcore_hooks.kernels.Truncation` (top-k / top-p / min-p recomputed from these
            logits): the log-probs and entropies are then of the distribution the rollout
            sampled from.
    """

    def __init__(
        self,
        *,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        kept_set: KeptSet = None,
    ) -> None:
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        _check_kept_set(kept_set)
        self.kept_set = kept_set

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        r, bs, _ = self.compute(ctx)
        return self.to_bs(r.logprob, bs)


class EntropyProcessor(_FusedProcessor):
    """Entropy of each token's distribution, float32 ``[b, s]``; needs no labels.

    Positions whose label is ``ignore_index`` give 0 when labels are passed (or derived with
    ``mask_from_labels=True``); otherwise every position is computed.

    Args:
        mask_from_labels: without ``labels``, derive them from ``input_ids`` to zero the
            positions that have no next token (sequence ends, padding).
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only on the
            torch backend and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
    """

    def __init__(
        self,
        *,
        mask_from_labels: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        _check_flag("mask_from_labels", mask_from_labels)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        self.mask_from_labels = mask_from_labels

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        with_labels = ctx.labels is not None or self.mask_from_labels
        r, bs, _ = self.compute(ctx, with_labels=with_labels)
        return self.to_bs(r.entropy, bs)


class LogprobEntropyProcessor(_FusedProcessor):
    """Log-prob and entropy from one pass over the vocabulary (one matmul, not two).

    Returns ``{"logprobs": [b, s], "entropy": [b, s]}``, or with ``as_tuple=True`` the tuple
    ``(logprobs, entropy)``: the form the combined-1F1B schedule plan takes (a tensor or a tuple
    of tensors; the scheduler calls ``loss_func(*outputs)``).

    Args:
        as_tuple: return ``(logprobs, entropy)`` instead of the dict.
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only on the
            torch backend and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
        kept_set: None (the full vocabulary), ``"replay"`` (renormalise over the rollout's
            sampling mask, :meth:`sampling_mask`) or a
            :class:`~mcore_hooks.kernels.Truncation` (top-k / top-p / min-p recomputed from these
            logits): the log-probs and entropies are then of the distribution the rollout
            sampled from.
    """

    def __init__(
        self,
        *,
        as_tuple: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        kept_set: KeptSet = None,
    ) -> None:
        _check_flag("as_tuple", as_tuple)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        _check_kept_set(kept_set)
        self.as_tuple = as_tuple
        self.kept_set = kept_set

    def process(self, ctx: PostprocessContext) -> Union[dict, tuple]:
        r, bs, _ = self.compute(ctx)
        logprobs, entropy = self.to_bs(r.logprob, bs), self.to_bs(r.entropy, bs)
        if self.as_tuple:
            return logprobs, entropy
        out = {"logprobs": logprobs, "entropy": entropy}
        if r.label_outside is not None:
            out["label_outside"] = self.to_bs(r.label_outside, bs)
        return out


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
            of the other tokens in the call (the default; False opts out, faster only on the
            torch backend and past 2 tensor-parallel ranks; see
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
    from elsewhere). The tokens that count are those whose label is not ``ignore_index``, times
    ``loss_mask`` when the model got one. Aggregation as verl's ``agg_loss``: ``token-mean``,
    ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` (a sequence is a row of the
    batch, or a packed sequence of THD input).

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
            of the other tokens in the call (the default; False opts out, faster only on the
            torch backend and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`). The gradient: where a token's
            weight does not follow the batch (``"token-sum"``); a mean divides every token's
            gradient by the call's count.
        upstream_grad: where the output weight's gradient goes into Megatron's ``main_grad``
            (``gradient_accumulation_fusion``), the gradient the returned loss will receive in
            the backward, declared so that the gradients are formed in the forward (6NHV) rather
            than recomputed in the backward (8NHV): under Megatron's schedules,
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
        """The per-token inputs, float ``[b, s]`` by name: ``output_processor_context``."""
        inputs = ctx.context
        if not isinstance(inputs, dict) and not hasattr(inputs, "items"):
            raise ValueError(
                "output_processor_context: expected a mapping of the loss' per-token inputs "
                "(e.g. {'old_logprobs': ..., 'advantages': ...}, each [b, s]), got "
                f"{type(inputs).__name__}"
            )
        return dict(inputs.items())

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
        for name, t in given.items():
            if not isinstance(t, torch.Tensor) or t.shape != (b, s):
                raise ValueError(
                    f"output_processor_context[{name!r}]: expected a [b, s] = ({b}, {s}) tensor, "
                    f"got {tuple(getattr(t, 'shape', ())) or type(t).__name__}"
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


class SelectedLogprobProcessor(_FusedProcessor):
    """Log-probabilities of ``K`` given ids per position under the full distribution, float32
    ``[b, s, K]`` (0 at -1 padding and at positions whose label is ``ignore_index``): one pass
    over the vocabulary for the normaliser, the ids' logits gathered (``K`` weight rows a
    token), differentiable.

    The ids are integer ``[b, s, K]`` global vocabulary ids (a teacher's top-k) in
    ``output_processor_context["selected_ids"]`` (override :meth:`selected_ids`). Labels (or
    ``input_ids``) give the positions that count; with ``with_label=True`` the result is
    ``{"selected": [b, s, K], "logprobs": [b, s]}``, the labels' log-probs from the same pass.

    Args:
        with_label: also return the labels' log-probs.
        temperature: as :class:`FusedLogprobProcessor`'s.
        ignore_index: as :class:`FusedLogprobProcessor`'s.
        chunk_size: as :class:`FusedLogprobProcessor`'s.
        backend: as :class:`FusedLogprobProcessor`'s.
        batch_invariant: as :class:`FusedLogprobProcessor`'s.
    """

    def __init__(
        self,
        *,
        with_label: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        _check_flag("with_label", with_label)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        self.with_label = with_label

    def selected_ids(self, ctx: PostprocessContext) -> torch.Tensor:
        """Integer ``[b, s, K]`` ids: ``output_processor_context["selected_ids"]``."""
        return _context_tensor(ctx, "selected_ids", "[b, s, K] vocabulary ids")

    def selected(self, ctx: PostprocessContext) -> tuple[LogprobEntropy, "_KernelInputs"]:
        """The kernel's results for this call, and its inputs."""
        k = self.kernel_inputs(ctx)
        ids = _per_token_ids("selected ids", self.selected_ids(ctx), *k.bs)
        return linear_logprob_entropy(k.hidden, k.weight, k.labels, **k.kwargs, selected_ids=ids), k

    def to_bsk(self, t: torch.Tensor, bs: tuple[int, int]) -> torch.Tensor:
        b, s = bs
        return t.view(s, b, t.shape[-1]).transpose(0, 1).clone(memory_format=torch.contiguous_format)

    def process(self, ctx: PostprocessContext) -> Union[torch.Tensor, dict]:
        r, k = self.selected(ctx)
        sel = self.to_bsk(r.selected, k.bs)
        return {"selected": sel, "logprobs": self.to_bs(r.logprob, k.bs)} if self.with_label else sel


class TopKDistillationProcessor(SelectedLogprobProcessor):
    """KL between a teacher and this model over the teacher's top-k, fused with the output layer.

    The default is verl's ``forward_kl_topk``: ``kl_t = sum_{i in top-k} p_i (log p_i - log
    q_i)``, ``p`` the teacher's log-probs as given (full-vocabulary log-probs, not renormalised),
    ``log q_i`` this model's under the full distribution (:class:`SelectedLogprobProcessor`),
    clamped at ``clamp_min`` (verl clamps at 0: a truncated sum can be negative). NeMo RL's
    ``DistillationLossFn`` renormalises the teacher over its top-k: ``renormalise="both"`` is its
    ``zero_outside_topk=False`` (the student renormalised too), ``renormalise="teacher"`` its
    ``zero_outside_topk=True`` (the student's full-vocabulary log-probs; the reverse KL then adds
    the student's mass outside the top-k against a teacher log-prob of -100 there,
    ``sum_{j not in top-k} q_j log q_j + 100 (1 - sum_{top-k} q)``, from the entropy of the same
    pass); ``kl_type`` and ``mixed_kl_weight`` are its ``kl_type`` and ``mixed_kl_weight``
    (``"mixed"``: ``w forward + (1 - w) reverse``), with ``clamp_min=None`` (it clamps nothing).
    With a renormalised teacher, ``teacher_logprobs`` may hold the teacher's top-k logits (NeMo
    RL passes those): a shift of a row changes nothing. Ids of -1, and teacher log-probs of
    -inf, are not in the top-k (NeMo RL has neither); a counted position with none left adds
    nothing. The reverse and mixed KL need ``renormalise``. The result is aggregated as
    :class:`PolicyLossProcessor`'s, over this call's tokens (NeMo RL and verl divide by the global
    batch's token count: use ``token-sum`` and divide by it).

    ``output_processor_context`` holds ``teacher_ids`` (integer ``[b, s, K]``, -1 padding) and
    ``teacher_logprobs`` (float ``[b, s, K]``), aligned with the labels. Counted positions:
    label not ``ignore_index``, times ``loss_mask``. Returns ``{"loss": scalar, "kl": [b, s]}``
    (the per-token KL detached), or the tuple ``(loss, kl)`` with ``as_tuple=True``. Under
    context parallelism the value is the whole sequences' on every CP rank, each rank's gradient
    its own tokens' share.

    Args:
        aggregation: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``.
        clamp_min: the per-token KL's lower clamp (None: none; verl: 0.0).
        as_tuple: return the tuple instead of the dict.
        kl_type: ``"forward"`` (``KL(p || q)``), ``"reverse"`` (``KL(q || p)``) or ``"mixed"``.
        mixed_kl_weight: ``w`` of ``"mixed"``, in ``[0, 1]``.
        renormalise: None (verl), ``"teacher"`` or ``"both"`` (NeMo RL), as above.
        temperature: as :class:`FusedLogprobProcessor`'s.
        ignore_index: as :class:`FusedLogprobProcessor`'s.
        chunk_size: as :class:`FusedLogprobProcessor`'s.
        backend: as :class:`FusedLogprobProcessor`'s.
        batch_invariant: as :class:`FusedLogprobProcessor`'s.
    """

    def __init__(
        self,
        *,
        aggregation: str = "token-mean",
        clamp_min: Optional[float] = 0.0,
        as_tuple: bool = False,
        kl_type: str = "forward",
        mixed_kl_weight: float = 0.5,
        renormalise: Optional[str] = None,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        if kl_type not in ("forward", "reverse", "mixed"):
            raise ValueError(f"kl_type: expected 'forward', 'reverse' or 'mixed', got {kl_type!r}")
        if isinstance(mixed_kl_weight, bool) or not isinstance(mixed_kl_weight, (int, float)) \
                or not 0.0 <= mixed_kl_weight <= 1.0:
            raise ValueError(f"mixed_kl_weight: expected a float in [0, 1], got {mixed_kl_weight!r}")
        if renormalise not in (None, "teacher", "both"):
            raise ValueError(f"renormalise: expected None, 'teacher' or 'both', got {renormalise!r}")
        if renormalise is None and kl_type != "forward":
            raise ValueError(
                f"kl_type={kl_type!r} needs a renormalised teacher (renormalise='teacher' or 'both', "
                "NeMo RL's): over an unrenormalised top-k the reverse KL is neither verl's loss nor "
                "NeMo RL's, and can be negative")
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {', '.join(map(repr, AGGREGATIONS))}, got {aggregation!r}")
        if clamp_min is not None and (isinstance(clamp_min, bool) or not isinstance(clamp_min, (int, float))
                                      or not is_finite(clamp_min)):
            raise ValueError(f"clamp_min: expected a finite float or None, got {clamp_min!r}")
        _check_flag("as_tuple", as_tuple)
        super().__init__(temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
                         backend=backend, batch_invariant=batch_invariant)
        self.aggregation, self.clamp_min, self.as_tuple = aggregation, clamp_min, as_tuple
        self.kl_type, self.mixed_kl_weight, self.renormalise = kl_type, float(mixed_kl_weight), renormalise

    def selected_ids(self, ctx: PostprocessContext) -> torch.Tensor:
        """``output_processor_context["teacher_ids"]``."""
        return _context_tensor(ctx, "teacher_ids", "the teacher's top-k ids, [b, s, K]")

    def process(self, ctx: PostprocessContext) -> Union[dict, tuple]:
        r, k = self.selected(ctx)
        b, s = k.bs
        ids = _per_token_ids("output_processor_context['teacher_ids']", self.selected_ids(ctx), b, s)
        teacher = _context_tensor(ctx, "teacher_logprobs", "the teacher's log-probs, [b, s, K]")
        if not isinstance(teacher, torch.Tensor) or not teacher.dtype.is_floating_point \
                or teacher.shape != (b, s, ids.shape[1]):
            raise ValueError(
                f"output_processor_context['teacher_logprobs']: expected a float [b, s, K] = "
                f"({b}, {s}, {ids.shape[1]}) tensor like teacher_ids, got "
                f"{tuple(getattr(teacher, 'shape', ())) or type(teacher).__name__}")
        counted = self.counted(ctx, k)
        seq, num_sequences = sequence_index(b, s, ctx.packed_seq_params, k.hidden.device, ctx.cp_size)
        token_weight = aggregation_weights(counted, self.aggregation, sequence_ids=seq.t().reshape(-1),
                                           num_sequences=num_sequences, group=_cp_group(ctx))
        log_p = teacher.detach().to(device=k.hidden.device, dtype=torch.float32)
        log_p = log_p.transpose(0, 1).reshape(b * s, log_p.shape[-1])
        ids = ids.to(k.hidden.device)
        # padding, positions that do not count, and ids of teacher probability 0: no term
        keep = (ids >= 0) & (counted != 0).unsqueeze(1) & (log_p > -math.inf)
        log_q = r.selected
        if self.renormalise is not None:
            log_p = _renormalised(log_p, keep)
        if self.renormalise == "both":
            log_q = _renormalised(log_q, keep)
        log_p = torch.where(keep, log_p, 0.0)
        kl = self._kl(log_p, log_q, keep, r.entropy)
        if self.clamp_min is not None:
            kl = kl.clamp(min=self.clamp_min)
        kl = torch.where(counted != 0, kl, 0.0)
        loss = _whole_value((token_weight * kl).sum(), ctx)
        kl_bs = self.to_bs(kl.detach(), k.bs)
        return (loss, kl_bs) if self.as_tuple else {"loss": loss, "kl": kl_bs}

    def _kl(self, log_p: torch.Tensor, log_q: torch.Tensor, keep: torch.Tensor,
            entropy: torch.Tensor) -> torch.Tensor:
        """Per-token ``[N]`` KL over the kept ``[N, K]`` entries (``where``, not products, so
        a masked entry adds nothing, NaN-proof)."""
        forward = reverse = None
        if self.kl_type != "reverse":
            forward = torch.where(keep, log_p.exp() * (log_p - log_q), 0.0).sum(dim=1)
        if self.kl_type != "forward":
            q = torch.where(keep, log_q.exp(), 0.0)
            q_log_q = torch.where(keep, q * log_q, 0.0).sum(dim=1)
            reverse = q_log_q - torch.where(keep, q * log_p, 0.0).sum(dim=1)
            if self.renormalise == "teacher":  # outside the top-k: sum q log q + 100 sum q
                tail = (-entropy - q_log_q) + 100.0 * (1.0 - q.sum(dim=1))
                reverse = reverse + torch.where(keep.any(dim=1), tail, 0.0)  # padding: no term
        if forward is None or reverse is None:
            return forward if reverse is None else reverse
        w = self.mixed_kl_weight
        return w * forward + (1.0 - w) * reverse


def _renormalised(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` log-values renormalised over each row's kept entries (0 elsewhere); a row
    with none kept stays finite, so no NaN reaches a gradient through ``where``."""
    filled = torch.where(keep, values, torch.finfo(values.dtype).min)
    return torch.where(keep, values - torch.logsumexp(filled, dim=1, keepdim=True), 0.0)


def megatron_upstream_grad(config: Any, num_microbatches: int, *, loss_func_returns: int = 2) -> float:
    """The ``upstream_grad`` to declare when the loss runs under Megatron Core's schedules
    (``get_forward_backward_func()``), from what the schedule knows: the model's config and the
    ``num_microbatches`` passed to the schedule.

    Megatron's ``forward_step_calc_loss`` scales the loss your ``loss_func`` returns in place
    before the backward (every release 0.13-0.19): ``(loss, logging)`` is multiplied by the
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


def _declared(kwargs: dict, upstream_grad: Optional[float]) -> dict:
    """The kernel keywords, with the declared upstream gradient where the weight's gradient goes
    into an accumulator (Megatron's ``main_grad``)."""
    if upstream_grad is None or "weight_grad_accumulator" not in kwargs:
        return kwargs
    return dict(kwargs, upstream_grad=upstream_grad)


def _cp_group(ctx: PostprocessContext) -> Any:
    return ctx.cp_group if ctx.cp_size > 1 else None


def _whole_value(loss: torch.Tensor, ctx: PostprocessContext) -> torch.Tensor:
    """Under context parallelism: the whole sequences' value (summed over the CP group), with
    this rank's gradient."""
    if ctx.cp_size == 1:
        return loss
    return loss + (group_sum(loss, ctx.cp_group) - loss.detach())

