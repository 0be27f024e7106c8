"""A few given vocabulary ids per token (a rollout's kept set, a teacher's top-k, a recomputed
top-k): their logits by gathering the ids' weight rows, and the distributions over them.

For a narrow set (``K <= V / 1024``, :func:`gathers`), ``K`` dot products a token instead of a
pass over the vocabulary: the logits of ``ids [N, K]`` are ``coef * (x @ W[ids].T)``, made in
token chunks of ``[chunk, K, H]`` gathered rows (input dtype, float32 products), and dX takes
``dz @ W[ids]``. A backend with its own gathered dot products (Triton: the rows read once, not
copied) makes the logits up to ``K = V / 256``. For a wider set, the ids' columns of a dense
product per vocabulary chunk. dW is always the dense form: the gradient scattered per
vocabulary chunk, one cuBLAS product (no ``[N, V]`` tensor in either form). Under tensor
parallelism each rank makes the logits of the ids in its vocabulary shard and 0 for the others,
and the ops sum them over the group: each id is owned by exactly one rank, so the sum is exact.

A padded id is ``-1``. The distributions over the ids (renormalised log-probs and entropy) are
``[N, K]`` float32 torch, differentiated by autograd; a recomputed truncation's selection of
them is :mod:`..kept_sets.truncation`'s.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from ..common.debug import check_values
from ..common.invariant import block_rows
from ..common.matmul import addmm_f32_, bmm_f32, mm_f32

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


# Bytes of one vocabulary chunk's [tokens, width] buffer in the dense passes.
_DENSE_BYTES = 128 << 20


# A backend's gathered dot products (Triton: K weight rows a token read once, at 88% of an
# H100's memory bandwidth) beat the dense product up to about K = V / 170 (11.3 against 20.0 ms
# at K = 512, 8192 x 4096 x 151936; benchmarks/profile_gather.py); used up to V / 256.
_DOTS_PER_VOCAB = 256


def gathers(k: int, v_local: int) -> bool:
    """Whether the ids' logits are gathered (``K`` weight rows a token: about ``6 N K H`` bytes
    moved) rather than taken from a dense product over the vocabulary shard (``2 N V H`` flops,
    the ids' columns kept). On an H100 the two cost the same near ``K = V / 1000`` (bf16,
    ``benchmarks/RESULTS.md``); the choice depends on the shapes alone, never on the tokens."""
    return k * 1024 <= v_local


def _vocab_chunks(n: int, v_local: int, itemsize: int) -> list[tuple[int, int]]:
    width = max(128, _DENSE_BYTES // (max(n, 1) * itemsize) // 128 * 128)
    return [(v0, min(v0 + width, v_local)) for v0 in range(0, v_local, width)]


def _fixed_gather(chunk_size: int, device: torch.device) -> int:
    """The gathers' padded token count under batch invariance: their chunk, at most the device's
    block (a small CPU call pads to 64 tokens, not to a chunk of thousands)."""
    return min(chunk_size, block_rows(device))


def _token_blocks(n: int, fixed: bool, rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + rows, n)) for s in range(0, n, rows)] if fixed else [(0, n)]


def _inside(rows: torch.Tensor, owned: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inside, columns)``: which ids fall in vocabulary rows ``[v0, v1)`` of the shard, and their
    columns there (0 elsewhere: a safe index, masked)."""
    cols = rows - v0
    inside = owned & (cols >= 0) & (cols < v1 - v0)
    return inside, torch.where(inside, cols, 0)


def candidate_logits(x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, ids: torch.Tensor,
                     vocab_start: int, chunk_size: int, fixed: bool = False,
                     dots: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                             Optional[torch.Tensor]]] = None) -> torch.Tensor:
    """Float32 ``[N, K]`` logits ``coef * x . W[id]`` of the ids this rank owns, 0 elsewhere:
    gathered, or for a wide ``K`` (:func:`gathers`) the columns of a dense product over the
    vocabulary. ``fixed`` (batch invariance): every product over a fixed number of tokens
    (padded): ``chunk_size`` for the gather (at most the device's block,
    ``invariant.block_rows``), the device's block for the dense product.
    ``dots``: a backend's gathered dot products (``Backend.gathered_dots``), used up to
    ``K = V / 256`` where the backend gives them (per token: invariant as they are)."""
    n, k = ids.shape
    v_local = weight.shape[0]
    owned, rows = owned_rows(ids, vocab_start, v_local)
    z = dots(x, weight, rows) if dots is not None and k * _DOTS_PER_VOCAB <= v_local else None
    if z is not None:
        return torch.where(owned, z.mul_(coef.unsqueeze(1)), 0.0)
    out = torch.zeros((n, k), dtype=torch.float32, device=x.device)
    if not gathers(k, v_local):
        block = block_rows(x.device)
        for start, end in _token_blocks(n, fixed, block):
            xb = _chunk(x, start, end, block, fixed, 0)
            o = out[start:end]
            for v0, v1 in _vocab_chunks(xb.shape[0], v_local, 4):
                z = mm_f32(xb, weight[v0:v1].t())[: end - start]
                inside, cols = _inside(rows[start:end], owned[start:end], v0, v1)
                o.copy_(torch.where(inside, z.gather(1, cols), o))
            o.mul_(coef[start:end].unsqueeze(1))
        return out
    if fixed:
        chunk_size = _fixed_gather(chunk_size, x.device)
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
    ``sum d_logits * logits``.

    dW, always, and dX for a wide ``K`` (:func:`gathers`): per vocabulary chunk the gradient is
    scattered into ``[tokens, width]`` (each id once a row, so the scatter is exact) and cuBLAS
    takes it: dW's rows rounded once (or added into the accumulator), so no float32 ``[V, H]``
    buffer and no ``index_add_`` (whose atomic adds vary a row's order between runs); dX summed
    in float32. For a narrow ``K`` dX takes ``dz @ W[ids]`` (gathered rows). ``fixed``: the
    gathers over ``chunk_size`` tokens, the dense products over the device's blocks, each
    padded."""
    n, h = x.shape
    v_local = weight.shape[0]
    owned, rows = owned_rows(ids, vocab_start, v_local)
    # coef * dL/dl, rounded to the input dtype as the stock output layer's logit gradient is
    dz = torch.where(owned, d_logits * coef.unsqueeze(1), 0.0).to(x.dtype)
    dx = torch.zeros((n, h), dtype=torch.float32, device=x.device) if need_x else None
    gather = gathers(ids.shape[1], v_local)
    dense_w = need_w  # always: no float32 [V, H] buffer, no atomic adds (run-to-run bitwise)
    dw = None
    # dense, one token block: each of dW's rows written once by a product over all the tokens
    once = dense_w and dw_accumulator is None and not fixed
    if need_w:
        if dw_accumulator is not None:
            dw = dw_accumulator
        elif once:
            dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
        else:
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    if gather:
        if fixed:
            chunk_size = _fixed_gather(chunk_size, x.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            dzc, r = _chunk(dz, start, end, chunk_size, fixed, 0), _chunk(rows, start, end, chunk_size, fixed, 0)
            if need_x:
                dx[start:end] = bmm_f32(dzc.unsqueeze(1), weight[r]).squeeze(1)[: end - start]
    if dense_w or (need_x and not gather):
        block = block_rows(x.device)
        for start, end in _token_blocks(n, fixed, block):
            xb = _chunk(x, start, end, block, fixed, 0)
            dzb = _chunk(dz, start, end, block, fixed, 0)
            rb, ob = _chunk(rows, start, end, block, fixed, 0), _chunk(owned, start, end, block, fixed, False)
            dxb = torch.zeros((xb.shape[0], h), dtype=torch.float32, device=x.device) if need_x and not gather else None
            for v0, v1 in _vocab_chunks(xb.shape[0], v_local, x.element_size()):
                inside, cols = _inside(rb, ob, v0, v1)
                d = torch.zeros((xb.shape[0], v1 - v0), dtype=x.dtype, device=x.device)
                d.scatter_add_(1, cols, torch.where(inside, dzb, 0.0).to(x.dtype))
                if once:
                    torch.mm(d.t(), xb, out=dw[v0:v1])  # K = all tokens: rounded once
                elif dense_w:
                    addmm_f32_(dw[v0:v1], d.t(), xb)
                if dxb is not None:
                    addmm_f32_(dxb, d, weight[v0:v1])
            if dxb is not None:
                dx[start:end] = dxb[: end - start]
    if dw is None or dw_accumulator is not None:
        return dx, None
    return dx, dw if once else dw.to(weight.dtype)


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
    missing = valid & ~found & (ids >= 0).any(dim=1)  # an empty row: a position not sampled
    if bool(missing.any()):
        i = int(missing.nonzero()[0])
        raise ValueError(
            f"{what}: the label of token {i} ({int(labels[i])}) is not in its kept set: the "
            f"rollout sampled it from that set, so the set or its alignment with the labels is "
            f"wrong ({int(missing.sum())} token(s))")


def kept_stats(logits: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor) -> KeptStats:
    """Log-prob of the label and entropy of ``softmax`` over each token's kept ids (``ids >= 0``),
    differentiable in ``logits [N, K]`` (float32). Ignored tokens and tokens whose row is empty
    (all -1: a prompt or padding position, which the rollout did not sample) give 0 and no
    gradient; a token whose non-empty row lacks its label gives NaN (bad input, refused where
    values are checked)."""
    keep = ids >= 0
    # a row with nothing kept becomes one kept 0 logit: finite, then zeroed
    empty = ~keep.any(dim=1, keepdim=True)
    valid = valid & ~empty.squeeze(1)
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
