"""PyTorch backend: the two passes of :mod:`..common.autograd` in token chunks. CPU and GPU.

Each chunk's logits ``[chunk, V_local]`` are made in float32 (bf16/fp16 products accumulate in
fp32 and are never rounded back), reduced, and dropped; the backward recomputes them. No tensor
larger than one chunk's logits (or the weight and hidden states themselves) is ever made.
"""

from __future__ import annotations

import torch

from ..common.autograd import Backend, LocalStats, upstream_grads
from ..common.matmul import addmm_f32_, mm_f32


def _chunk_logits(x, weight, coef, start, end):
    z = mm_f32(x[start:end], weight.t())
    return z.mul_(coef[start:end].unsqueeze(1))


# A padded logit: exp of it less the row's max is 0, and 0 times it is 0 (-inf would give NaN).
_PAD = -1e30
_ALIGN = 16  # floats: 64-byte rows


def _aligned_logits(x, weight, coef, start, end):
    """:func:`_chunk_logits` in rows padded to a multiple of 16 floats with :data:`_PAD`: every
    row then starts at the same alignment, so the GPU's row reductions (vectorised loads, a
    misaligned head handled apart) sum each row in the same order wherever it sits: batch
    invariance. The padding adds exact zeros to every sum and never wins a max."""
    v = weight.shape[0]
    vp = -(-v // _ALIGN) * _ALIGN
    z = torch.empty((end - start, vp), dtype=torch.float32, device=x.device)
    mm_f32(x[start:end], weight.t(), out=z[:, :v])
    z[:, :v].mul_(coef[start:end].unsqueeze(1))
    z[:, v:] = _PAD  # after the scaling: a large 1 / temperature would take it to -inf (0 * -inf)
    return z


def kept_columns(z: torch.Tensor, floor: torch.Tensor, local_label: torch.Tensor) -> torch.Tensor:
    """Which of a chunk's scaled logits ``z [c, V_local]`` are in each token's kept set given as
    a floor (:mod:`..kept_sets.nucleus`): ``floor [c, 2]`` holds the set's smallest logit and the last
    column kept among those equal to it (ties go in ascending id), so the set is ``z > floor``,
    or ``z == floor`` up to that column; the label's column always (the rollout sampled it)."""
    tau, cut = floor[:, :1], floor[:, 1:]
    col = torch.arange(z.shape[1], device=z.device)
    return (z > tau) | ((z == tau) & (col <= cut)) | (col == local_label.unsqueeze(1))


def aligned_rows(t: torch.Tensor, fill: float) -> torch.Tensor:
    """``t [c, V]`` copied into rows padded to a multiple of 16 with ``fill`` (as above)."""
    v = t.shape[1]
    out = t.new_full((t.shape[0], -(-v // _ALIGN) * _ALIGN), fill)
    out[:, :v] = t
    return out


class TorchChunked(Backend):
    name = "torch"

    def __init__(self, aligned: bool = False) -> None:
        # aligned: rows padded for batch invariance (set by InvariantBlocks)
        self.aligned = aligned

    def local_stats(self, x, weight, coef, local_label, chunk_size, floor=None) -> LocalStats:
        return self.local_stats_top_k(x, weight, coef, local_label, chunk_size, 0, self.aligned, floor)[0]

    @staticmethod
    def each_chunk(x, weight, coef, chunk_size, fn) -> None:
        """``fn(start, end, z)`` on each chunk's float32 scaled logits, the chunks and products of
        :meth:`grads` (and of :meth:`local_stats` with a floor): the same bits in every pass."""
        for start in range(0, x.shape[0], chunk_size):
            end = min(start + chunk_size, x.shape[0])
            fn(start, end, _chunk_logits(x, weight, coef, start, end))

    @staticmethod
    def local_stats_top_k(x, weight, coef, local_label, chunk_size, top_k, aligned=False, floor=None):
        """:meth:`local_stats`, and with ``top_k > 0`` each token's ``min(top_k, V_local)``
        largest logits and their local rows, taken from the same chunks (None otherwise).
        ``floor``: over each token's kept set alone (:func:`kept_columns`), the logits made as
        :meth:`grads` makes them (a column's membership is decided on the same bits)."""
        n = x.shape[0]
        f32 = dict(dtype=torch.float32, device=x.device)
        m, s, a, t = (torch.empty(n, **f32) for _ in range(4))
        kk = min(top_k, weight.shape[0])
        top = (torch.empty((n, kk), **f32), torch.empty((n, kk), dtype=torch.long, device=x.device)) if kk else None
        owned = local_label >= 0
        index = local_label.clamp(min=0).unsqueeze(1)  # gather at a safe index, then mask: no sync
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            if floor is None:
                z = (_aligned_logits if aligned else _chunk_logits)(x, weight, coef, start, end)
            else:
                z = _chunk_logits(x, weight, coef, start, end)
                z.masked_fill_(~kept_columns(z, floor[start:end], local_label[start:end]), _PAD)
                z = aligned_rows(z, _PAD) if aligned else z
            t[start:end] = torch.where(owned[start:end], z.gather(1, index[start:end]).squeeze(1), 0.0)
            if top is not None:
                top[0][start:end], top[1][start:end] = z.topk(kk, dim=1)
            zmax = z.amax(dim=1)
            m[start:end] = zmax
            z.sub_(zmax.unsqueeze(1))  # l - m_loc <= 0
            e = torch.exp(z)
            s[start:end] = e.sum(dim=1)
            a[start:end] = (e * z).sum(dim=1)
            del z, e
        return LocalStats(m, s, a, t), top

    @staticmethod
    def grads(x, weight, coef, local_label, m, log_s, entropy, g1, g2, valid, chunk_size, need_x,
              need_w, dw_accumulator=None, extra=None, floor=None):
        n = x.shape[0]
        g1, g2 = upstream_grads(valid, g1, g2, m)
        dx = torch.empty_like(x) if need_x else None
        if need_w:
            dw = dw_accumulator if dw_accumulator is not None else torch.zeros(
                weight.shape, dtype=torch.float32, device=x.device)
        owned = local_label >= 0
        index = local_label.clamp(min=0).unsqueeze(1)
        g_target = torch.where(owned, g1, 0.0).unsqueeze(1)
        if extra is not None:  # a safe column, 0 added where there is none
            e_cols, e_g = extra[0].clamp(min=0), torch.where(extra[0] >= 0, extra[1], 0.0)
        # dL/dl_j = -p_j (g1 + g2 (log p_j + H)) + g1 1[j = y]; then dz = coef * dl
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _chunk_logits(x, weight, coef, start, end)
            kept = None if floor is None else kept_columns(z, floor[start:end], local_label[start:end])
            z.sub_(m[start:end].unsqueeze(1)).sub_(log_s[start:end].unsqueeze(1))  # log p
            p = torch.exp(z)
            z.add_(entropy[start:end].unsqueeze(1)).mul_(g2[start:end].unsqueeze(1))
            z.add_(g1[start:end].unsqueeze(1)).mul_(p).neg_()
            del p
            if kept is not None:  # outside the kept set: no term (a fill, never NaN * 0)
                z.masked_fill_(~kept, 0.0)
                del kept
            z.scatter_add_(1, index[start:end], g_target[start:end])
            if extra is not None:
                z.scatter_add_(1, e_cols[start:end], e_g[start:end])
            dz = z.mul_(coef[start:end].unsqueeze(1)).to(x.dtype)  # rounded as stock rounds it
            del z
            if need_x:
                dx[start:end] = mm_f32(dz, weight)
            if need_w:
                addmm_f32_(dw, dz.t(), x[start:end])
            del dz
        if not need_w or dw_accumulator is not None:
            return dx, None
        return dx, dw.to(weight.dtype)

    def row_stats(self, z, coef, local_label, with_entropy) -> LocalStats:
        l = z * coef.unsqueeze(1)
        if self.aligned:
            l = aligned_rows(l, _PAD)
        m = l.amax(dim=1)
        t = l.gather(1, local_label.clamp(min=0).unsqueeze(1)).squeeze(1)
        d = l.sub_(m.unsqueeze(1))  # l - m <= 0
        e = torch.exp(d)
        a = (e * d).sum(dim=1) if with_entropy else torch.zeros_like(m)
        return LocalStats(m, e.sum(dim=1), a, torch.where(local_label >= 0, t, 0.0))

    @staticmethod
    def row_grad(z, coef, local_label, m, log_s, g1, g2, entropy, out):
        # log p, then dL/dl = -p (g1 + g2 (log p + H)) + g1 1[j = y]; dz = coef * dL/dl
        logp = (z * coef.unsqueeze(1)).sub_(m.unsqueeze(1)).sub_(log_s.unsqueeze(1))
        g = torch.exp(logp)
        if g2 is None:
            g.mul_(-g1.unsqueeze(1))
        else:
            g.mul_(logp.add_(entropy.unsqueeze(1)).mul_(g2.unsqueeze(1)).add_(g1.unsqueeze(1))).neg_()
        owned = local_label >= 0
        g.scatter_add_(1, local_label.clamp(min=0).unsqueeze(1), torch.where(owned, g1, 0.0).unsqueeze(1))
        return out.copy_(g.mul_(coef.unsqueeze(1)))
