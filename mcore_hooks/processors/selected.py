"""Processors over given ids: their log-probs under the full distribution, and top-k distillation
from a teacher's ids."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ..kernels import LogprobEntropy, aggregation_weights, linear_logprob_entropy
from ..kernels.common.losses import AGGREGATIONS
from ..kernels.common.options import is_finite
from ..postprocess import PostprocessContext
from .labels import sequence_index
from .fused import (
    _KernelInputs,
    _check_flag,
    _context_tensor,
    _cp_group,
    _FusedProcessor,
    _per_token_ids,
    _whole_value,
)


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
