"""The fused processors' base: the hook's keywords adapted to the kernels (:mod:`mcore_hooks.kernels`).

Each processor adapts the hook's keywords to :func:`mcore_hooks.kernels.linear_logprob_entropy` (or
a fused loss): it flattens ``[s, b, h]`` hidden states and ``[b, s]`` labels to tokens, takes the
vocab-parallel layout from the context (TP group, this rank's vocab range, sequence parallelism),
folds Megatron's MuP logit scale into the kernel, and returns float32 ``[b, s]`` like the stock
loss. No ``[tokens, vocab]`` logits are made; the output layer's weight is read directly. The
processors themselves, one family a module: :mod:`.logprob` (log-probs and entropies),
:mod:`.losses` (linear cross-entropy, policy losses), :mod:`.selected` (given ids' log-probs,
top-k distillation).

Where the model's config asks for ``gradient_accumulation_fusion`` and the output weight has a
float32 ``main_grad`` (Megatron DDP), the weight's gradient is added into ``main_grad`` in float32
in the backward, and the weight is marked ``grad_added_to_main_grad`` with a placeholder gradient,
as Megatron's own linear layers do: the log-prob pass allocates no ``[V, h]`` gradient, the
placeholder is ``[V/tp, h]`` (Megatron's protocol; DDP's hook drops it at once). The losses whose
gradients are formed in the forward hold their float32 ``[V/tp, h]`` weight gradient (or, for
few tokens, their logit gradient) until the backward, which adds it into ``main_grad`` scaled by
the upstream gradient (known only there), unless ``upstream_grad`` declares that gradient: then
it goes into ``main_grad`` in the forward and nothing of that size is held.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Optional, Union

import torch

from .. import compat, main_grad
from ..debug import check_values
from ..kernels import (
    BACKENDS,
    LogprobEntropy,
    Truncation,
    VocabParallel,
    linear_logprob_entropy,
    triton_unavailable,
)
from ..kernels.common.losses import group_sum
from ..kernels.common.dispatch import tracing
from ..kernels.common.options import is_finite
from ..mtp import MTPDepth, MTPLoss, fused_mtp_loss
from ..postprocess import PostprocessContext, PostprocessProcessor
from .labels import is_thd, labels_from_input_ids, per_request, per_token_temperature

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
    per-request top-k on the host, where it was given. A per-sample top-k given on the host
    stays there, one per token (unpacked batches: their tokens' samples are known on the host),
    so that the kernels group the tokens by their own width (batch invariance across requests
    of different top-k); packed ones' sequences are known on the device only."""
    def spread(name: str, device: Optional[torch.device]) -> Any:
        value = getattr(t, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        dtype = torch.long if name == "top_k" else torch.float32  # [0, 0] is a float option too
        return per_request(f"kept_set.{name}", torch.as_tensor(value, dtype=dtype), b, s,
                           ctx.packed_seq_params, ctx.cp_size, device)

    if all(isinstance(getattr(t, f), (int, float)) for f in ("top_k", "top_p", "min_p")):
        return t
    device = ctx.hidden_states.device
    # (traced: the kernels read no widths from a traced tensor, so the device form, as before)
    on_host = not (isinstance(t.top_k, torch.Tensor) and t.top_k.device.type != "cpu") and not is_thd(
        ctx.packed_seq_params) and not tracing()
    if on_host and not isinstance(t.top_k, int):
        return dataclasses.replace(t, top_k=spread("top_k", torch.device("cpu")),
                                   top_p=spread("top_p", device), min_p=spread("min_p", device))
    top_k = spread("top_k", device)
    width = t.max_top_k
    if not isinstance(top_k, int) and width is None:  # the host's copy: no device read
        ks = t.top_k.tolist() if isinstance(t.top_k, torch.Tensor) else list(t.top_k)
        # <= 0 means none: the whole vocabulary (the kernel caps the width at it)
        width = max(int(k) if int(k) > 0 else 1 << 62 for k in ks)
    return dataclasses.replace(t, top_k=top_k, top_p=spread("top_p", device), min_p=spread("min_p", device),
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

    def __repr__(self) -> str:
        """The class and its options as keywords (a tensor by its shape and dtype)."""
        def show(v: Any) -> str:
            if isinstance(v, torch.Tensor):
                return f"tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
            return repr(v)

        opts = ", ".join(f"{k}={show(v)}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({opts})"

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
