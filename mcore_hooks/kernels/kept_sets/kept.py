"""The kept-set passes of :func:`~mcore_hooks.kernels.linear_logprob_entropy`: log-probs and
entropies of the distribution renormalised over each token's kept set (given ``kept_ids``, or a
rollout engine's truncation recomputed from these logits, :mod:`.truncation`), its requests
grouped where their own options set their width; and log-probs of given ids under the full
distribution (``selected_ids``). The ids' logits come from :mod:`..passes.candidates_op`, the full
statistics from :mod:`..passes.stats_op`."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..passes import candidates as cand
from ..passes import candidates_op, ops, stats_op
from . import nucleus
from . import truncation as trunc
from ..passes.arguments import _id_matrix, _nan_where
from ..common.autograd import GlobalStats, label_is_row_max
from ..common.comm import group_rank_size
from ..common.debug import check_values
from ..common.dispatch import call
from ..common.options import KernelParams, LogprobEntropy
from .truncation import Truncation


def kept_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, p: KernelParams, v_total: int,
                         truncation: Optional[Truncation], kept_ids: Optional[torch.Tensor],
                         prepare_group: Callable[[torch.Tensor, torch.Tensor, bool], KernelParams],
                         ) -> LogprobEntropy:
    """The kept-set route of :func:`~mcore_hooks.kernels.linear_logprob_entropy`: the call's
    tokens renormalised over their kept sets, or, where a truncation's requests make their sets
    in more than one way (:meth:`Truncation._groups`), each group as its own options make it
    (``prepare_group(hidden rows, their indices, first group)``: that group's params), merged
    back into the call's order."""
    groups = None  # (not under sequence parallelism: the rows are gathered from every rank)
    if truncation is not None and ops.invariant(p.backend) and not p.sequence_parallel:
        groups = truncation._groups(p.n, v_total)
    if groups is None:
        return _renormalised(hidden, weight, p, truncation, kept_ids, v_total)
    parts = []
    for j, (index, t) in enumerate(groups):
        i = index.to(hidden.device)
        h = hidden.index_select(0, i)
        # one placeholder a backward: the groups' would add into a dense [V, H] zeros
        parts.append(_renormalised(h, weight, prepare_group(h, i, j == 0), t, None, v_total, index))
    return _merged(parts, [index for index, _ in groups], hidden.device)


def kept_sets_with_a_label(kept_ids: torch.Tensor, p: KernelParams, counted: torch.Tensor,
                           token_weight: torch.Tensor, v_total: int) -> torch.Tensor:
    """``kept_ids`` for a policy loss: a counted token was sampled from something, so an empty
    row (all -1) among them is refused where values are checked, and unchecked made the set of
    one id other than its label (the token's label is then outside its set: NaN, with NaN
    gradients; an empty row has no logit a gradient could reach)."""
    if not (isinstance(kept_ids, torch.Tensor) and kept_ids.dim() == 2 and kept_ids.shape[0] == p.n):
        return kept_ids  # the log-prob pass refuses it, named
    kept_ids = kept_ids.to(p.labels.device)
    empty = counted & ~(kept_ids >= 0).any(dim=1)
    if check_values(empty) and bool(empty.any()):
        i = int(empty.nonzero()[0])
        raise ValueError(
            f"kept_ids: token {i} counts in the loss (token_weight {float(token_weight[i]):g}) but "
            f"its kept set is empty (all -1): the mask is short or shifted against the labels "
            f"({int(empty.sum())} token(s))")
    first = torch.arange(kept_ids.shape[1], device=kept_ids.device) == 0
    other = ((p.labels + 1) % v_total).to(kept_ids.dtype).unsqueeze(1)
    return torch.where(empty.unsqueeze(1) & first, other, kept_ids)


def _renormalised(hidden: torch.Tensor, weight: torch.Tensor, p: KernelParams,
                  truncation: Optional[Truncation], kept_ids: Optional[torch.Tensor], v_total: int,
                  index: Optional[torch.Tensor] = None) -> LogprobEntropy:
    """:class:`LogprobEntropy` of the distribution renormalised over each token's kept set, a
    truncation's or ``kept_ids``. ``index``: the tokens' places in the caller's call (a group's:
    errors name those)."""
    if truncation is not None and truncation._keeps_everything(v_total):
        # no truncation (vLLM's defaults): the set is the vocabulary, its distribution the full
        # one, from the statistics pass (no [tokens, vocab] kept set)
        logprob, entropy, logz, best = stats_op.stats(hidden, weight, p)
        return LogprobEntropy(logprob, entropy, logz, best, label_outside=torch.zeros_like(p.valid))
    if truncation is not None and truncation._width(v_total) >= v_total:
        # a set that may be the whole vocabulary (no top-k): by a floor, never [tokens, vocab]
        return nucleus.renormalised(hidden, weight, p, truncation, v_total, index)
    if truncation is not None:
        ids, outside, bad = _truncated(hidden, weight, p, truncation, index)
    else:
        ids, bad = _id_matrix("kept_ids", kept_ids, p.n, v_total, hidden.device, p.valid)
        cand.check_kept_ids(ids, p.labels, p.valid, v_total)
        found, _ = cand.label_columns(ids, p.labels)
        outside = p.valid & ~found & (ids >= 0).any(dim=1)  # refused where checked
        # unchecked: NaN there, its gradients too (NaN coefficients: never dropped silently)
        bad = bad | outside
    p = _nan_where(p, bad)
    if ops.invariant(p.backend):
        ids = cand.aligned_columns(ids)
    r = cand.kept_stats(candidates_op.logits_of(hidden, weight, ids, p), ids, p.labels, p.valid)
    return LogprobEntropy(r.logprob, r.entropy, r.logz, r.label_is_argmax, label_outside=outside)


def _merged(parts: list[LogprobEntropy], indices: list[torch.Tensor], device: torch.device) -> LogprobEntropy:
    """The groups' results in the call's token order (each token in one group: its values,
    and through the gather its gradient, as its group gave them)."""
    order = torch.argsort(torch.cat(indices)).to(device)  # on the host: no device read

    def field(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name) for r in parts]).index_select(0, order)

    return LogprobEntropy(field("logprob"), field("entropy"), field("logz"), field("label_is_argmax"),
                          label_outside=field("label_outside"))


def _truncated(hidden: torch.Tensor, weight: torch.Tensor, p: KernelParams,
               t: Truncation, index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kept ids [N, width + 1], label outside [N], bad [N])``: the kept set of a truncation
    of these logits by its engine's rule, the label added where the rule dropped it (no
    gradient: a selection); which labels that was; which tokens cannot be answered (ties
    beyond the width, options out of range). ``index``: the tokens' places in the caller's
    call, for errors."""
    _, tp = group_rank_size(p.group)
    v_total = weight.shape[0] * tp
    opts = t._per_token(p.n, hidden.device, v_total)
    width = t._width(v_total)
    values, ids, m, log_s = call(candidates_op.top_k_ids, hidden.detach(), weight.detach(), p.coef,
                                 p.vocab_start, ops.group_name(p.group), p.sequence_parallel,
                                 p.chunk_size, width, ops.invariant(p.backend))
    if ops.invariant(p.backend):  # aligned rows for the sort's softmax and cumulative sum
        pad = cand.aligned_columns(ids).shape[1] - ids.shape[1]
        values = torch.cat([values, values.new_full((values.shape[0], pad), -math.inf)], dim=1)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), -1)], dim=1)
    kept, overflow = trunc.truncate(values, ids, opts, t.engine, m, log_s, v_total, p.labels)
    bad = (overflow | opts.bad) & p.valid
    if check_values(bad) and bool(bad.any()):
        i = int(bad.nonzero()[0])
        place = i if index is None else int(index[i])
        why = ("its top-k options are out of range" if bool(opts.bad[i]) else
               f"its top_k {int(opts.top_k[i])} (or the logits tied with its {int(opts.top_k[i])}-th "
               f"largest, which vLLM's rule keeps) does not fit the kept set's width "
               f"{width}; raise Truncation.ties (now {t.ties}) or max_top_k")
        raise ValueError(f"truncation: token {place}: {why}")
    kept, outside = trunc.with_labels(kept, p.labels, p.valid)
    return kept, outside, bad


def selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, p: KernelParams,
                      selected_ids: torch.Tensor, v_total: int, with_label: bool) -> LogprobEntropy:
    """Log-probs of ``selected_ids`` (and of the labels) under the full distribution: one
    statistics pass that also makes the ids' logits, the label's among them (no label of its
    own: its log-prob output is then ``-logZ``, with the gradient ``-p``), one backward taking
    both gradients. Ids out of range are refused where values are checked, NaN where not."""
    ids, bad = _id_matrix("selected_ids", selected_ids, p.n, v_total, hidden.device, p.valid)
    p = _nan_where(p, bad)
    none = torch.full_like(p.labels, -1)
    cols = torch.cat([ids, torch.where(p.valid, p.labels, -1).unsqueeze(1)], dim=1) if with_label else ids
    out = call(stats_op.logsoftmax_stats, hidden, weight, none, p.valid, p.coef, p.vocab_start,
               ops.group_name(p.group), p.sequence_parallel, p.chunk_size, p.backend,
               p.weight_grad_accumulator, p.dummy_weight_grad, cols, torch.compiler.is_compiling())
    neg_logz, entropy, logz, m, log_s, logits = out[0], out[1], out[2], out[4], out[5], out[7]
    # (l - m) - log s, as the statistics pass rounds it; the gradient of -logZ added as an exact 0
    value = (logits - m.unsqueeze(1)) - log_s.unsqueeze(1)
    lp = value + (neg_logz - neg_logz.detach()).unsqueeze(1)
    lp = torch.where(p.valid.unsqueeze(1) & (cols >= 0), lp, 0.0)
    if not with_label:
        return LogprobEntropy(None, entropy, logz, None, lp)
    label_logit = logits[:, -1]
    best = p.valid & label_is_row_max(GlobalStats(m, log_s, entropy, label_logit))
    return LogprobEntropy(lp[:, -1], entropy, logz, best, lp[:, :-1])
