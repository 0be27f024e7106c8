"""The checks ``mcore-hooks verify`` runs (:mod:`mcore_hooks.verify` runs them): each bundled
processor with what stock computes for it (float32 models, :data:`PROCESSOR_CHECKS`) and its
float64 reference (bf16 models, :data:`PRECISION_CHECKS`); the integrations' (verl's, NeMo RL's)
on GPTModel, the model those frameworks run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch

from .kernels import PolicyLoss
from .postprocess import DefaultProcessor, PostprocessContext
from .integrations import FusedOutputProcessorContext, NemoRLLogprobProcessor, VerlFusedProcessor
from .processors import (
    EntropyProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
    PolicyLossProcessor,
    SelectedLogprobProcessor,
    TopKDistillationProcessor,
)
from .testing import TinyModelConfig

__all__ = ["ProcessorCheck", "PrecisionCheck", "PROCESSOR_CHECKS", "PRECISION_CHECKS"]

@dataclasses.dataclass(frozen=True)
class ProcessorCheck:
    """One processor to verify on float32 models: how to make it, what stock computes for it, how
    close it must be.

    ``tolerance`` is the largest allowed relative error of values and gradients; 0 means bitwise.
    ``context``: the ``output_processor_context`` the processor takes, made from the batch.
    ``inputs``: the model's keyword arguments made from the tiny batch (None: the batch as
    made), for a processor whose framework calls the model its own way (NeMo RL:
    ``labels=input_ids``). ``models``: the model classes it runs on (None: every class).
    """

    name: str
    make: Callable[[], Optional[Callable[..., Any]]]
    reference: Callable[[torch.nn.Module, dict], torch.Tensor]
    with_labels: bool
    tolerance: float = 0.0
    context: Optional[Callable[[dict], Any]] = None
    inputs: Optional[Callable[[dict], dict]] = None
    models: Optional[tuple[str, ...]] = None


def _stock(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)


def _stock_logprob(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return -model(**batch)  # the stock per-token loss is -log p(label)


def _stock_entropy(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Entropy from the stock, gathered logits with a float64 log-softmax."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kwargs, runtime_gather_output=True)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1).float()


def _stock_logprob_entropy(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.stack([_stock_logprob(model, batch), _stock_entropy(model, batch)])


def _masked_sum(loss: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return (loss * mask).sum() if mask is not None else loss.sum()


def _masked_mean(loss: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    # Megatron's schedules: the masked sum over the token count, at least 1
    return (loss * mask).sum() / mask.sum().clamp(min=1) if mask is not None else loss.mean()


# fp32 tolerance for the fused processors: they sum in a different order than stock.
_FP32 = 1e-5

# The policy check's loss: every term (clip-higher, dual clip, KL k3, entropy bonus).
_POLICY = PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_type="k3",
                     entropy_coef=0.01)


class _PolicyLossValue(PolicyLossProcessor):
    """``PolicyLossProcessor``'s loss alone (its log-probs and entropies are detached metrics)."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        return super().process(ctx)["loss"]


def _policy_inputs(batch: dict) -> dict:
    """The policy check's per-token inputs, ``[b, s]`` like the labels and fixed by their shape:
    old log-probs about the tiny model's (ratios on both sides of the clip range), advantages of
    both signs, reference log-probs for the KL term."""
    labels = batch["labels"]
    g = torch.Generator().manual_seed(1234)
    uniform = -math.log(TinyModelConfig.vocab_size)
    inputs = {
        "old_logprobs": uniform + 0.3 * torch.randn(labels.shape, generator=g),
        "advantages": torch.randn(labels.shape, generator=g),
        "ref_logprobs": uniform + 0.3 * torch.randn(labels.shape, generator=g),
    }
    return {k: v.to(labels.device) for k, v in inputs.items()}


def _policy_value(logprob: torch.Tensor, entropy: torch.Tensor, mask: Optional[torch.Tensor],
                  inputs: dict) -> torch.Tensor:
    """The token-mean policy loss from ``[b, s]`` log-probs and entropies (any float dtype)."""
    terms = _POLICY(logprob, entropy, **{k: v.to(logprob.dtype) for k, v in inputs.items()})
    w = torch.ones_like(terms) if mask is None else mask.to(terms.dtype)
    return (terms * w).sum() / w.sum().clamp(min=1)


def _stock_policy(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The stock RL path: gathered logits, a float64 log-softmax, the loss in torch."""
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    logp = torch.log_softmax(model(**kwargs, runtime_gather_output=True).double(), dim=-1)
    lp = logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return _policy_value(lp, ent, batch.get("loss_mask"), _policy_inputs(batch)).float()


def _gathered_logp(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The stock model's gathered logits, a float64 log-softmax: ``[b, s, V]``."""
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    return torch.log_softmax(model(**kwargs, runtime_gather_output=True).double(), dim=-1)


def _id_sets(batch: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``K = 4`` distinct vocabulary ids per position, ``[b, s, K]`` (-1 padding at some), and a
    teacher's full-vocabulary log-probs of them: a random teacher's top-k, fixed by the labels'
    shape."""
    labels = batch["labels"]
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(2.0 * torch.randn(*labels.shape, TinyModelConfig.vocab_size, generator=g), -1)
    logprobs, ids = teacher.topk(4, dim=-1)
    pad = torch.rand(labels.shape, generator=g) < 0.25  # a position's last id: padding
    ids[..., -1] = torch.where(pad, -1, ids[..., -1])
    ids[0, 0] = -1  # a position with no id at all
    return ids.to(labels.device), logprobs.to(labels.device)


def _selected_inputs(batch: dict) -> dict:
    return {"selected_ids": _id_sets(batch, 4321)[0]}


def _teacher_inputs(batch: dict) -> dict:
    ids, logprobs = _id_sets(batch, 5678)
    return {"teacher_ids": ids, "teacher_logprobs": logprobs}


class _SelectedValues(SelectedLogprobProcessor):
    """``SelectedLogprobProcessor(with_label=True)``'s two outputs as one ``[b, s, K + 1]``: the
    ids' log-probs, then the label's."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        out = super().process(ctx)
        return torch.cat([out["selected"], out["logprobs"].unsqueeze(-1)], dim=-1)


def _selected_value(logp: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """From ``[b, s, V]`` log-probs: the ids' (0 at padding) and the label's, ``[b, s, K + 1]``."""
    sel = torch.where(ids >= 0, logp.gather(-1, ids.clamp(min=0)), 0.0)
    return torch.cat([sel, logp.gather(-1, labels.unsqueeze(-1))], dim=-1)


def _stock_selected(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    ids = _selected_inputs(batch)["selected_ids"]
    return _selected_value(_gathered_logp(model, batch), batch["labels"], ids).float()


# The distillation checks' losses: verl's forward_kl_topk (the default: the teacher's log-probs as
# given, the KL clamped at 0, the token mean), and NeMo RL's mixed KL against a teacher
# renormalised over its top-k, the student too ("both") or the student's mass outside the top-k
# against a teacher log-prob of -100 ("teacher": the entropy of the same pass), per sequence.
_DISTILL_VERL: dict = {}
_DISTILL_NEMO_TEACHER = dict(kl_type="mixed", mixed_kl_weight=0.3, renormalise="teacher", clamp_min=None,
                             aggregation="seq-mean-token-mean")
_DISTILL_NEMO_BOTH = dict(_DISTILL_NEMO_TEACHER, renormalise="both")


class _DistillLoss(TopKDistillationProcessor):
    """``TopKDistillationProcessor``'s loss alone (its per-token KL is a detached metric)."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        return super().process(ctx)["loss"]


def _renormalise(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    norm = torch.logsumexp(torch.where(keep, values, -math.inf), -1, keepdim=True)
    return torch.where(keep, values - norm, 0.0)


def _distill_value(logp: torch.Tensor, mask: Optional[torch.Tensor], sequences: torch.Tensor,
                   inputs: dict, options: dict) -> torch.Tensor:
    """The top-k distillation loss of ``options`` (``TopKDistillationProcessor``'s keywords)
    from ``[b, s, V]`` log-probs, written out over the teacher's top-k: ``KL(p || q)``,
    ``KL(q || p)`` or ``w`` of the first plus ``1 - w`` of the second, then aggregated over
    the counted tokens (``mask``) as verl's ``agg_loss``."""
    kl_type, w = options.get("kl_type", "forward"), options.get("mixed_kl_weight", 0.5)
    renormalise, clamp_min = options.get("renormalise"), options.get("clamp_min", 0.0)
    ids = inputs["teacher_ids"]
    counted = torch.ones_like(logp[..., 0]) if mask is None else mask.to(logp.dtype)
    keep = (ids >= 0) & (counted[..., None] != 0)
    log_p = torch.where(keep, inputs["teacher_logprobs"].to(logp.dtype), 0.0)
    log_q = torch.where(keep, logp.gather(-1, ids.clamp(min=0)), 0.0)
    if renormalise is not None:
        log_p = _renormalise(log_p, keep)
    if renormalise == "both":
        log_q = _renormalise(log_q, keep)
    p, q = torch.where(keep, log_p.exp(), 0.0), torch.where(keep, log_q.exp(), 0.0)
    forward, reverse = (p * (log_p - log_q)).sum(-1), (q * (log_q - log_p)).sum(-1)
    if renormalise == "teacher":  # the student's mass outside the top-k, the teacher's -100 there
        outside = (logp.exp() * logp).sum(-1) - (q * log_q).sum(-1) + 100.0 * (1.0 - q.sum(-1))
        reverse = reverse + torch.where(keep.any(-1), outside, 0.0)
    kl = {"forward": forward, "reverse": reverse, "mixed": w * forward + (1 - w) * reverse}[kl_type]
    if clamp_min is not None:
        kl = kl.clamp(min=clamp_min)
    kl = torch.where(counted != 0, kl, 0.0) * counted
    if options.get("aggregation", "token-mean") == "token-mean":
        return kl.sum() / counted.sum().clamp(min=1)
    n = int(sequences.max()) + 1  # seq-mean-token-mean
    seq = sequences.reshape(-1)
    per_seq = kl.new_zeros(n).index_add_(0, seq, kl.reshape(-1))
    count = kl.new_zeros(n).index_add_(0, seq, counted.reshape(-1))
    return (per_seq / count.clamp(min=1)).sum() / (count > 0).sum().clamp(min=1)


def _sequences(labels: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
    """Each ``[b, s]`` position's sequence: its row, or its packed sequence (``cu_seqlens_q``)."""
    if packed_seq_params is None:
        return torch.arange(labels.shape[0], device=labels.device)[:, None].expand(labels.shape)
    lengths = packed_seq_params.cu_seqlens_q.long().diff().to(labels.device)
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=labels.device), lengths)[None]


def _batch_sequences(batch: dict) -> torch.Tensor:
    return _sequences(batch["labels"], batch.get("packed_seq_params"))


def _stock_distill(options: dict) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    def reference(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return _distill_value(_gathered_logp(model, batch), batch.get("loss_mask"), _batch_sequences(batch),
                              _teacher_inputs(batch), options).float()

    return reference


def _per_sample(batch: dict) -> torch.Tensor:
    """One temperature per sample (per packed sequence of a packed batch)."""
    params = batch.get("packed_seq_params")
    n = batch["labels"].shape[0] if params is None else params.cu_seqlens_q.shape[0] - 1
    return torch.tensor([0.6, 1.3, 0.9, 1.1][:n], device=batch["labels"].device)


def _verl_context(batch: dict) -> FusedOutputProcessorContext:
    return FusedOutputProcessorContext(temperature=_per_sample(batch))


class _VerlValues(VerlFusedProcessor):
    """``VerlFusedProcessor``'s ``VerlFusedOutput`` as one ``[2, tokens]``: log-probs, entropies."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        out = super().process(ctx)
        return torch.stack([out.log_probs, out.entropy])


def _verl_value(logits: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor,
                sequences: torch.Tensor) -> torch.Tensor:
    """verl's formula from ``[b, s, V]`` logits: each token's at its sample's temperature,
    flattened over ``[b, s]``."""
    logp = torch.log_softmax(logits / temperature.to(logits.dtype)[sequences].unsqueeze(-1), dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return torch.stack([lp.reshape(-1), -(logp.exp() * logp).sum(-1).reshape(-1)])


def _stock_verl(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    logits = model(**kwargs, runtime_gather_output=True).double()
    return _verl_value(logits, batch["labels"], _per_sample(batch), _batch_sequences(batch)).float()


_NEMO_T = 0.7


def _nemo_inputs(batch: dict) -> dict:
    """NeMo RL's call: ``labels=input_ids`` (unshifted), no loss mask."""
    out = {k: v for k, v in batch.items() if k != "loss_mask"}
    out["labels"] = batch["input_ids"]
    return out


def _nemo_value(logp: torch.Tensor, ids: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
    """``[B, S-1]`` log-probs of ``ids[:, 1:]`` from ``[b, s, V]`` log-probs at temperature;
    0 at each packed sequence's last position (no label crosses a boundary)."""
    lp = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if packed_seq_params is not None:
        ends = packed_seq_params.cu_seqlens_q[1:-1].long().to(ids.device) - 1
        lp = lp.index_fill(1, ends, 0.0)
    return lp


def _stock_nemo(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    logp = torch.log_softmax(model(**kwargs, runtime_gather_output=True).double() / _NEMO_T, dim=-1)
    return _nemo_value(logp, batch["input_ids"], batch.get("packed_seq_params")).float()


# verl and NeMo RL run GPTModel (their Megatron backends build it): the integrations against it.
_FRAMEWORK_MODELS = ("gpt",)

_HOOK_OFF = "hook off (None)"  # the hooked class without a processor: stock's own path

PROCESSOR_CHECKS: tuple[ProcessorCheck, ...] = (
    ProcessorCheck(_HOOK_OFF + ", loss", lambda: None, _stock, with_labels=True),
    ProcessorCheck("DefaultProcessor, loss", DefaultProcessor, _stock, with_labels=True),
    ProcessorCheck("DefaultProcessor, logits", DefaultProcessor, _stock, with_labels=False),
    ProcessorCheck("FusedLogprobProcessor", FusedLogprobProcessor, _stock_logprob, True, _FP32),
    ProcessorCheck("EntropyProcessor", EntropyProcessor, _stock_entropy, False, _FP32),
    ProcessorCheck(
        "LogprobEntropyProcessor", lambda: LogprobEntropyProcessor(as_tuple=True),
        _stock_logprob_entropy, True, _FP32,
    ),
    ProcessorCheck("LinearCEProcessor", LinearCEProcessor, _stock, True, _FP32),
    ProcessorCheck(
        "LinearCEProcessor, sum", lambda: LinearCEProcessor(reduction="sum"),
        lambda m, b: _masked_sum(m(**b), b.get("loss_mask")), True, _FP32,
    ),
    ProcessorCheck(
        "LinearCEProcessor, mean", lambda: LinearCEProcessor(reduction="mean"),
        lambda m, b: _masked_mean(m(**b), b.get("loss_mask")), True, _FP32,
    ),
    ProcessorCheck(
        "PolicyLossProcessor", lambda: _PolicyLossValue(loss=_POLICY), _stock_policy, True, _FP32,
        context=_policy_inputs,
    ),
    ProcessorCheck(
        "SelectedLogprobProcessor", lambda: _SelectedValues(with_label=True), _stock_selected, True,
        _FP32, context=_selected_inputs,
    ),
    ProcessorCheck(
        "TopKDistillationProcessor", _DistillLoss, _stock_distill(_DISTILL_VERL), True, _FP32,
        context=_teacher_inputs,
    ),
    ProcessorCheck(
        "TopKDistillationProcessor, mixed, teacher renormalised",
        lambda: _DistillLoss(**_DISTILL_NEMO_TEACHER), _stock_distill(_DISTILL_NEMO_TEACHER), True,
        _FP32, context=_teacher_inputs,
    ),
    ProcessorCheck(
        "VerlFusedProcessor", _VerlValues, _stock_verl, True, _FP32, context=_verl_context,
        models=_FRAMEWORK_MODELS,
    ),
    ProcessorCheck(
        "NemoRLLogprobProcessor", lambda: NemoRLLogprobProcessor(temperature=_NEMO_T), _stock_nemo,
        True, _FP32, inputs=_nemo_inputs, models=_FRAMEWORK_MODELS,
    ),
)


# --------------------------------------------------------------------------- bf16 vs float64


@dataclasses.dataclass(frozen=True)
class PrecisionCheck:
    """One processor to verify on bf16 models against float64, beside the stock post-process.

    ``stock(ctx)``: what stock computes from the hook's keywords through its own output layer
    (bf16 logits); ``exact(logp, ctx)``: the same from float64 log-probabilities over the whole
    vocabulary (``[s, b, V]``); both return the processor's output layout (``[b, s]``, stacked
    pairs, or a scalar).
    """

    name: str
    make: Callable[[], Callable[..., Any]]
    stock: Callable[[PostprocessContext], torch.Tensor]
    exact: Callable[[torch.Tensor, PostprocessContext], torch.Tensor]
    context: Optional[Callable[[dict], Any]] = None
    inputs: Optional[Callable[[dict], dict]] = None  # as ProcessorCheck's
    models: Optional[tuple[str, ...]] = None  # as ProcessorCheck's


def _stock_logits(ctx: PostprocessContext, gather: bool) -> torch.Tensor:
    logits, _ = ctx.output_layer(ctx.hidden_states, weight=ctx.output_weight, runtime_gather_output=gather)
    return ctx.scale_logits(logits)


def _stock_logprob_bs(ctx: PostprocessContext) -> torch.Tensor:
    # the stock loss: Megatron's vocab-parallel cross-entropy of the bf16 logits
    return -ctx.compute_language_model_loss(ctx.labels, _stock_logits(ctx, gather=False))


def _stock_entropy_bs(ctx: PostprocessContext) -> torch.Tensor:
    # the stock RL path: gathered bf16 logits, an fp32 log-softmax
    logp = torch.log_softmax(_stock_logits(ctx, gather=True).float(), dim=-1)
    return -(logp.exp() * logp).sum(-1).t()


def _exact_logprob(logp: torch.Tensor, ctx: PostprocessContext) -> torch.Tensor:
    return logp.gather(-1, ctx.labels.t().unsqueeze(-1)).squeeze(-1).t()


def _exact_entropy(logp: torch.Tensor, ctx: PostprocessContext) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1).t()


def _mask(ctx: PostprocessContext) -> Optional[torch.Tensor]:
    return None if ctx.loss_mask is None else ctx.loss_mask.to(torch.float64)


def _stock_policy_bs(ctx: PostprocessContext) -> torch.Tensor:
    logp = torch.log_softmax(_stock_logits(ctx, gather=True).float(), dim=-1)  # [s, b, V]
    lp = logp.gather(-1, ctx.labels.t().unsqueeze(-1)).squeeze(-1).t()
    return _policy_value(lp, -(logp.exp() * logp).sum(-1).t(), ctx.loss_mask, ctx.context)


def _exact_policy(logp: torch.Tensor, ctx: PostprocessContext) -> torch.Tensor:
    return _policy_value(_exact_logprob(logp, ctx), _exact_entropy(logp, ctx), _mask(ctx), ctx.context)


def _stock_logp_bs(ctx: PostprocessContext, temperature: Any = 1.0) -> torch.Tensor:
    # the stock RL path: gathered bf16 logits, an fp32 log-softmax; [b, s, V]
    return torch.log_softmax(_stock_logits(ctx, gather=True).float() / temperature, dim=-1).transpose(0, 1)


def _ctx_sequences(ctx: PostprocessContext) -> torch.Tensor:
    return _sequences(ctx.labels, ctx.packed_seq_params)


def _stock_distill_bs(options: dict) -> Callable[[PostprocessContext], torch.Tensor]:
    return lambda c: _distill_value(_stock_logp_bs(c), c.loss_mask, _ctx_sequences(c), c.context, options)


def _exact_distill(options: dict) -> Callable[[torch.Tensor, PostprocessContext], torch.Tensor]:
    return lambda p, c: _distill_value(p.transpose(0, 1), _mask(c), _ctx_sequences(c), c.context, options)


def _verl_bf16(logits: torch.Tensor, ctx: PostprocessContext) -> torch.Tensor:
    """verl's formula from ``[s, b, V]`` logits (or float64 log-probs: the same softmax)."""
    return _verl_value(logits.transpose(0, 1), ctx.labels, ctx.context.temperature, _ctx_sequences(ctx))


PRECISION_CHECKS: tuple[PrecisionCheck, ...] = (
    PrecisionCheck("FusedLogprobProcessor", FusedLogprobProcessor, _stock_logprob_bs, _exact_logprob),
    PrecisionCheck("EntropyProcessor", EntropyProcessor, _stock_entropy_bs, _exact_entropy),
    PrecisionCheck(
        "LogprobEntropyProcessor", lambda: LogprobEntropyProcessor(as_tuple=True),
        lambda c: torch.stack([_stock_logprob_bs(c), _stock_entropy_bs(c)]),
        lambda p, c: torch.stack([_exact_logprob(p, c), _exact_entropy(p, c)]),
    ),
    PrecisionCheck(
        "LinearCEProcessor", LinearCEProcessor,
        lambda c: -_stock_logprob_bs(c), lambda p, c: -_exact_logprob(p, c),
    ),
    PrecisionCheck(
        "LinearCEProcessor, sum", lambda: LinearCEProcessor(reduction="sum"),
        lambda c: _masked_sum(-_stock_logprob_bs(c), c.loss_mask),
        lambda p, c: _masked_sum(-_exact_logprob(p, c), _mask(c)),
    ),
    PrecisionCheck(
        "LinearCEProcessor, mean", lambda: LinearCEProcessor(reduction="mean"),
        lambda c: _masked_mean(-_stock_logprob_bs(c), c.loss_mask),
        lambda p, c: _masked_mean(-_exact_logprob(p, c), _mask(c)),
    ),
    PrecisionCheck(
        "PolicyLossProcessor", lambda: _PolicyLossValue(loss=_POLICY), _stock_policy_bs, _exact_policy,
        context=_policy_inputs,
    ),
    PrecisionCheck(
        "SelectedLogprobProcessor", lambda: _SelectedValues(with_label=True),
        lambda c: _selected_value(_stock_logp_bs(c), c.labels, c.context["selected_ids"]),
        lambda p, c: _selected_value(p.transpose(0, 1), c.labels, c.context["selected_ids"]),
        context=_selected_inputs,
    ),
    # NeMo RL's other form, both renormalised: the teacher-renormalised form's value is mostly
    # the constant 100 (1 - sum q) of each token, which the logits' rounding hardly moves (both
    # paths' values within float32 rounding of float64: "at least as accurate" a coin toss);
    # the float32 checks hold it to stock, values and every gradient.
    PrecisionCheck(
        "TopKDistillationProcessor", _DistillLoss, _stock_distill_bs(_DISTILL_VERL),
        _exact_distill(_DISTILL_VERL), context=_teacher_inputs,
    ),
    PrecisionCheck(
        "TopKDistillationProcessor, mixed, both renormalised", lambda: _DistillLoss(**_DISTILL_NEMO_BOTH),
        _stock_distill_bs(_DISTILL_NEMO_BOTH), _exact_distill(_DISTILL_NEMO_BOTH), context=_teacher_inputs,
    ),
    PrecisionCheck(
        "VerlFusedProcessor", _VerlValues,
        lambda c: _verl_bf16(_stock_logits(c, gather=True).float(), c), _verl_bf16,
        context=_verl_context, models=_FRAMEWORK_MODELS,
    ),
    PrecisionCheck(
        "NemoRLLogprobProcessor", lambda: NemoRLLogprobProcessor(temperature=_NEMO_T),
        lambda c: _nemo_value(_stock_logp_bs(c, _NEMO_T), c.labels, c.packed_seq_params),
        lambda p, c: _nemo_value(torch.log_softmax(p / _NEMO_T, -1).transpose(0, 1), c.labels,
                                 c.packed_seq_params),
        inputs=_nemo_inputs, models=_FRAMEWORK_MODELS,
    ),
)
