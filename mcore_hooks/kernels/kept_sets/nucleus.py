"""A truncation whose kept set may be as wide as the vocabulary (a request without top-k, with
top-p or min-p), without making ``[tokens, vocab]`` kept sets: each token's set, which every
engine's rule keeps as a prefix of its logits sorted descending (ties by ascending id; the
label ahead of its ties for SGLang's), is given by a floor, its smallest logit and the last id
kept among those equal to it (``op truncation_floor``, no gradient); the statistics pass and
its backward then run over the columns at or above the floor (the torch backend's chunks,
:func:`~..torch_backend.torch_chunked.kept_columns`), the logits of every pass made by the same products, so
a column's membership is decided on the same bits in each.

The floor pass sorts each token's whole row (the engines' rules are over sorted rows), a few
rows at a time, so its memory stays within :data:`_SORT_BYTES` whatever the call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..passes import candidates as cand
from ..common import comm
from ..passes import ops, stats_op
from . import truncation as trunc
from ..passes.arguments import _nan_where
from ..common.debug import check_values
from ..common.dispatch import call, custom_op
from ..passes.ops import _F32, _group, group_name
from ..common.options import KernelParams, LogprobEntropy
from ..torch_backend.torch_chunked import _ALIGN, aligned_rows

# Bytes of one group of sorted rows' work, and per logit of a row: its values (padded, and
# sorted), ids and the sort's indices (8 bytes each), the rule's float32 rows (the cumulative
# sum's, the masked values) and its kept ids: about 80 by count. At most _SORT_ROWS rows a
# group: with batch invariance every group is padded to that many (a small call's few rows).
_SORT_BYTES = 1 << 28
_ROW_BYTES = 96
_SORT_ROWS = 64


@custom_op("mcore_hooks::truncation_floor", mutates_args=())
def truncation_floor(
    hidden: Tensor, weight: Tensor, coef: Tensor, labels: Tensor, valid: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, backend: str, engine: str,
    top_k: Tensor, top_p: Tensor, min_p: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(floor [N, 2], label_outside [N])``: each token's kept set of ``engine``'s truncation
    (per-token options ``top_k``, normalised, ``top_p``, ``min_p``) of its float32 scaled logits,
    as the set's smallest logit and the last local column (this rank's) kept among those equal
    to it, -1 where none; and where the rule did not keep the label (``labels``: global ids).
    The logits are ``backend``'s (the torch backend's, by name) chunk products."""
    pg = _group(group)
    x = comm.gather_tokens(hidden, pg) if sequence_parallel else hidden
    n, world = x.shape[0], comm.group_rank_size(pg)[1]
    v_total = weight.shape[0] * world
    vp = -(-v_total // _ALIGN) * _ALIGN  # aligned rows: each row summed in one order (invariance)
    floor = torch.zeros((n, 2), dtype=_F32, device=x.device)
    outside = torch.zeros(n, dtype=torch.bool, device=x.device)
    step = max(1, min(_SORT_ROWS, _SORT_BYTES // (_ROW_BYTES * vp)))
    # batch invariance: every group of rows the rule sees has `step` rows, whatever the call's size
    # (a short one padded with rows of zeros, cut off after), so its row-wise sums (SGLang's
    # normaliser), softmax and scans add each row in one order; a one-row group's sum was split
    # otherwise, and moved a top-p cut
    fixed = ops.invariant(backend)
    all_ids = torch.arange(vp, device=x.device)
    all_ids = torch.where(all_ids < v_total, all_ids, -1)

    def padded(t: Tensor, rows: int, fill: float) -> Tensor:
        return t if t.shape[0] == rows else torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), fill)])

    def rule(start: int, end: int, z: Tensor) -> None:
        for a in range(start, end, step):
            b = min(a + step, end)
            rows = slice(a, b)
            zr = z[a - start : b - start]
            if world > 1:
                zr = comm.gather_columns(zr, pg)  # the whole row: the rules sort it
            zr = aligned_rows(zr, -math.inf)  # padding: never a candidate
            r = step if fixed else b - a
            zr = padded(zr, r, 0.0)
            lab = padded(labels[rows], r, -1)
            none = torch.zeros(r, dtype=torch.bool, device=x.device)  # options checked by the caller
            if engine == "sglang":  # its rule is over the full vocabulary's probabilities
                m = zr.amax(dim=1)
                log_s = torch.log(torch.exp(zr - m.unsqueeze(1)).sum(dim=1))
            else:  # vLLM's takes none: no pass for them
                m = log_s = none.float()
            ids = all_ids.expand(r, vp)
            opts = trunc.TokenTruncation(padded(top_k[rows], r, v_total), padded(top_p[rows], r, 1.0),
                                         padded(min_p[rows], r, 0.0), none)
            kept, _ = trunc.truncate(zr, ids, opts, engine, m, log_s, v_total, lab, ids_ascending=True)
            kept, zr, lab = kept[: b - a], zr[: b - a], lab[: b - a]
            # a prefix of the sorted row: its last entry is the floor
            last = kept.gather(1, ((kept >= 0).sum(dim=1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
            floor[rows, 0] = zr.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
            cut = last
            if engine == "sglang":  # its label goes ahead of its ties: the last kept, no other tie is
                cut = torch.where(last == lab, -1, last)
            floor[rows, 1] = torch.where(cut >= 0, cut - vocab_start, -1).float()  # exact below 2**24
            outside[rows] = valid[rows] & ~cand.label_columns(kept, lab)[0]

    ops._backend(backend, x.device).each_chunk(x, weight, coef, chunk_size, rule)
    return floor, outside


@truncation_floor.register_fake
def _(hidden, weight, coef, labels, valid, vocab_start, group, sequence_parallel, chunk_size, backend,
      engine, top_k, top_p, min_p):
    n = labels.shape[0]
    return hidden.new_empty((n, 2), dtype=_F32), hidden.new_empty(n, dtype=torch.bool)


def renormalised(hidden: Tensor, weight: Tensor, p: KernelParams, t: "trunc.Truncation", v_total: int,
                 index: Optional[Tensor] = None) -> LogprobEntropy:
    """:class:`LogprobEntropy` of the distribution renormalised over each token's kept set of
    truncation ``t`` (the label added where the rule dropped it), through a floor: no
    ``[tokens, vocab]`` set. ``index``: the tokens' places in the caller's call, for errors."""
    opts = t._per_token(p.n, hidden.device, v_total)
    bad = opts.bad & p.valid
    if check_values(bad) and bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"truncation: token {i if index is None else int(index[i])}: its top-k "
                         f"options are out of range")
    # the torch backend's passes, on the blocks batch invariance gives it where it is on
    q = dataclasses.replace(p, backend="torch+invariant" if ops.invariant(p.backend) else "torch")
    floor, outside = call(truncation_floor, hidden.detach(), weight.detach(), q.coef, q.labels, q.valid,
                          q.vocab_start, group_name(q.group), q.sequence_parallel, q.chunk_size,
                          q.backend, t.engine, opts.top_k, opts.top_p, opts.min_p)
    q = _nan_where(q, bad)
    logprob, entropy, logz, best = stats_op.stats(hidden, weight, q, floor)
    return LogprobEntropy(logprob, entropy, logz, best, label_outside=outside)
