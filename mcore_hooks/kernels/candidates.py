"""A few given vocabulary ids per token (a rollout's kept set, a teacher's top-k, a recomputed
top-k): their logits by gathering the ids' weight rows, and the distributions over them.

``K`` dot products a token instead of a pass over the vocabulary: the logits of ``ids [N, K]``
are ``coef * (x @ W[ids].T)``, made in token chunks of ``[chunk, K, H]`` gathered rows (input
dtype, float32 products), never ``[N, V]``. Their gradient is the same gather: dX takes
``dz @ W[ids]``, dW an ``index_add_`` of ``dz x`` into the ids' rows. Under tensor parallelism
each rank makes the logits of the ids in its vocabulary shard and 0 for the others, and the
ops sum them over the group: each id is owned by exactly one rank, so the sum is exact.

A padded id is ``-1``. The distributions over the ids (renormalised log-probs and entropy, a
recomputed truncation's selection) are ``[N, K]`` float32 torch, differentiated by autograd.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from .debug import check_values
from .matmul import addmm_f32_, bmm_f32

# Elements of one chunk's gathered rows as float32 products ([chunk, K, H]; 256 MiB).
_GATHER_ELEMENTS = 1 << 26


def gather_chunk_size(k: int, h: int) -> int:
    """Tokens per chunk of the gather passes: about ``2**26`` gathered elements, at least 1."""
    return max(1, _GATHER_ELEMENTS // max(1, k * h))


def owned_rows(ids: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owned, rows)``: which ids this rank's shard holds, and their rows (0 where not owned,
    a safe index: gathered, then masked, so nothing waits on the device)."""
    local = ids - vocab_start
    owned = (ids >= 0) & (local >= 0) & (local < v_local)
    return owned, torch.where(owned, local, 0)


def _chunk(t: torch.Tensor, start: int, end: int, rows: int, fixed: bool, fill) -> torch.Tensor:
    """Rows ``[start, end)`` of ``t``; with ``fixed``, padded with ``fill`` to ``rows`` (every
    product then has one shape: batch invariance)."""
    part = t[start:end]
    if not fixed or end - start == rows:
        return part
    out = part.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[: end - start] = part
    return out


def candidate_logits(x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, ids: torch.Tensor,
                     vocab_start: int, chunk_size: int, fixed: bool = False) -> torch.Tensor:
    """Float32 ``[N, K]`` logits ``coef * x . W[id]`` of the ids this rank owns, 0 elsewhere.
    ``fixed``: the last chunk padded to ``chunk_size`` tokens (batch invariance)."""
    n, k = ids.shape
    owned, rows = owned_rows(ids, vocab_start, weight.shape[0])
    out = torch.empty((n, k), dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        r = _chunk(rows, start, end, chunk_size, fixed, 0)
        z = bmm_f32(weight[r], _chunk(x, start, end, chunk_size, fixed, 0).unsqueeze(2)).squeeze(2)
        z = z[: end - start].mul_(coef[start:end].unsqueeze(1))
        out[start:end] = torch.where(owned[start:end], z, 0.0)
    return out


def candidate_grads(x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, ids: torch.Tensor,
                    vocab_start: int, d_logits: torch.Tensor, chunk_size: int, need_x: bool,
                    need_w: bool, dw_accumulator: Optional[torch.Tensor] = None, fixed: bool = False,
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dX (float32, this rank's ids' share; the ops reduce it over the group) and dW (input
    dtype; or None with ``dw_accumulator``, a float32 tensor it is added into) of
    ``sum d_logits * logits``. ``fixed`` (batch invariance): chunks padded to one shape, and on
    a GPU dW formed by a dense product per chunk (a scatter into ``[chunk, V_local]``, then
    cuBLAS: ``2 chunk V H`` flops) instead of ``index_add_``, whose atomic adds make the order
    of a row's terms vary between runs."""
    n, h = x.shape
    v_local = weight.shape[0]
    owned, rows = owned_rows(ids, vocab_start, v_local)
    # coef * dL/dl, rounded to the input dtype as the stock output layer's logit gradient is
    dz = torch.where(owned, d_logits * coef.unsqueeze(1), 0.0).to(x.dtype)
    dx = torch.empty((n, h), dtype=torch.float32, device=x.device) if need_x else None
    dw = None
    if need_w:
        dw = dw_accumulator if dw_accumulator is not None else torch.zeros(
            weight.shape, dtype=torch.float32, device=x.device)
    dense = fixed and x.is_cuda
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        dzc, r = _chunk(dz, start, end, chunk_size, fixed, 0), _chunk(rows, start, end, chunk_size, fixed, 0)
        xc = _chunk(x, start, end, chunk_size, fixed, 0)
        if need_x:
            dx[start:end] = bmm_f32(dzc.unsqueeze(1), weight[r]).squeeze(1)[: end - start]
        if need_w and dense:
            # the not-owned entries add an exact 0 at column 0: the sum is the same in any order
            full = torch.zeros((dzc.shape[0], v_local), dtype=x.dtype, device=x.device)
            addmm_f32_(dw, full.scatter_add_(1, r, dzc).t(), xc)
        elif need_w:
            # not-owned entries add an exact 0 into row 0
            outer = dzc.float().unsqueeze(2) * xc.float().unsqueeze(1)
            dw.index_add_(0, r.reshape(-1), outer.reshape(-1, h))
    if dw is not None and dw_accumulator is None:
        dw = dw.to(weight.dtype)
    elif dw_accumulator is not None:
        dw = None
    return dx, dw


def aligned_columns(ids: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """``ids [N, K]`` padded with -1 to a multiple of 16 columns: every row of the ``[N, K]``
    float32 work then starts at the same alignment, so the GPU's row reductions sum each row in
    the same order wherever it sits (batch invariance)."""
    k = ids.shape[1]
    kp = -(-k // multiple) * multiple
    if kp == k:
        return ids
    return torch.cat([ids, ids.new_full((ids.shape[0], kp - k), -1)], dim=1)


class KeptStats(NamedTuple):
    """Float32 ``[N]`` results of a distribution renormalised over each token's kept ids."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    logz: torch.Tensor
    label_is_argmax: torch.Tensor


def label_columns(ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(found, column)``: whether each token's label is among its ids, and where."""
    match = (ids == labels.unsqueeze(1)) & (ids >= 0)
    return match.any(dim=1), match.to(torch.uint8).argmax(dim=1)


def check_kept_ids(ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, v_total: int,
                   what: str = "kept set") -> None:
    """Where values are checked (CPU, or debug checks on): ids in the vocabulary or -1, none
    repeated in a row, and every counted token's label in its row."""
    if not check_values(ids):
        return
    bad = (ids < -1) | (ids >= v_total)
    if bool(bad.any()):
        raise ValueError(f"{what}: ids must be vocabulary ids in [0, {v_total}) or -1 (padding), "
                         f"got {int(ids[bad][0])}")
    s = ids.sort(dim=1).values
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise ValueError(f"{what}: an id is repeated within a token's row (each is counted once)")
    found, _ = label_columns(ids, labels)
    missing = valid & ~found
    if bool(missing.any()):
        i = int(missing.nonzero()[0])
        raise ValueError(
            f"{what}: the label of token {i} ({int(labels[i])}) is not in its kept set: the "
            f"rollout sampled it from that set, so the set or its alignment with the labels is "
            f"wrong ({int(missing.sum())} token(s))")


def kept_stats(logits: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor) -> KeptStats:
    """Log-prob of the label and entropy of ``softmax`` over each token's kept ids (``ids >= 0``),
    differentiable in ``logits [N, K]`` (float32). Ignored tokens give 0; a counted token whose
    label is not kept gives NaN (bad input, refused where values are checked)."""
    keep = ids >= 0
    # a row with nothing kept (an ignored position) becomes one kept 0 logit: finite, then zeroed
    empty = ~keep.any(dim=1, keepdim=True)
    first = torch.zeros_like(keep)
    first[:, 0] = True
    keep = keep | (empty & first)
    z = torch.where(keep, logits, torch.where(empty, 0.0, -math.inf))
    logp = torch.log_softmax(z, dim=1)
    logp_kept = torch.where(keep, logp, 0.0)  # no 0 * -inf, in value or gradient
    entropy = -(logp_kept.exp() * logp_kept).sum(dim=1)
    found, col = label_columns(ids, labels)
    lp = logp_kept.gather(1, col.unsqueeze(1)).squeeze(1)
    lp = torch.where(found, lp, math.nan)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    logz = torch.logsumexp(z.detach(), dim=1)
    best = found & (z.detach().gather(1, col.unsqueeze(1)).squeeze(1) >= z.detach().amax(dim=1))
    return KeptStats(torch.where(valid, lp, zero), torch.where(valid, entropy, zero),
                     torch.where(valid, logz, zero), valid & best)


@dataclasses.dataclass(frozen=True)
class Truncation:
    """A sampler's truncation, recomputed from the trainer's own logits, as vLLM applies it:
    temperature first (the logits the kernels see are already divided by it), then min-p, then
    top-k, then top-p on the top-k-renormalised distribution (vLLM's ``apply_top_k_top_p`` and
    ``min_p``, the order of its Model Runner V2 sampler).

    * ``min_p``: keeps ``p_j >= min_p * p_max``, i.e. ``l_j >= l_max + log(min_p)``;
    * ``top_k``: the ``k`` largest logits, exactly ``k`` (vLLM's Triton kernel, its GPU default,
      keeps exactly ``k``; its PyTorch reference would keep every tie of the ``k``-th value);
    * ``top_p``: sorted ascending, drops a token while the cumulative mass up to it is
      ``<= 1 - top_p``; the most likely token is always kept.

    The label (the token the rollout sampled) is always kept, as every sampler's kept set holds
    its sampled token: where the trainer's logits differ from the rollout's near a boundary the
    label may otherwise fall just outside.

    Attributes:
        top_k: tokens kept before top-p (required: it bounds the kept set, as vLLM's and SGLang's
            sampling masks require a finite ``top_k``).
        top_p: the nucleus mass in ``(0, 1]`` (1: off).
        min_p: the minimum probability relative to the most likely token, in ``[0, 1]`` (0: off).
    """

    top_k: int
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k: expected a positive int (it bounds the kept set), got {self.top_k!r}")
        for name, lo_open in (("top_p", True), ("min_p", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (0 < v <= 1 if lo_open else 0 <= v <= 1):
                raise ValueError(f"{name}: expected a float in {'(0, 1]' if lo_open else '[0, 1]'}, got {v!r}")


def truncate(values: torch.Tensor, ids: torch.Tensor, t: Truncation) -> torch.Tensor:
    """The kept ids ``[N, k]`` (-1 where dropped) of a token's top-k ``values`` (float32 scaled
    logits, any order) and their global ``ids``, with min-p and top-p applied."""
    vals, order = values.sort(dim=1)  # ascending, as vLLM's reference sorts
    ids = ids.gather(1, order)
    if t.min_p > 0:
        vals = vals.masked_fill(vals < vals[:, -1:] + math.log(t.min_p), -math.inf)
    if t.top_p < 1:
        cum = torch.cumsum(torch.softmax(vals, dim=1), dim=1)
        drop = cum <= 1 - t.top_p
        drop[:, -1] = False  # at least one
        vals = vals.masked_fill(drop, -math.inf)
    return torch.where(torch.isfinite(vals), ids, -1)


def with_labels(kept: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``kept [N, k]`` with a last column holding each counted token's label where it was not
    kept (-1 elsewhere)."""
    found, _ = label_columns(kept, labels)
    extra = torch.where(valid & ~found, labels, -1)
    return torch.cat([kept, extra.unsqueeze(1)], dim=1)
