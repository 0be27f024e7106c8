"""PyTorch backend: the two passes of :mod:`.autograd` in token chunks. CPU and GPU.

Each chunk's logits ``[chunk, V_local]`` are made in float32 (bf16/fp16 products accumulate in
fp32 and are never rounded back), reduced, and dropped; the backward recomputes them. No tensor
larger than one chunk's logits (or the weight and hidden states themselves) is ever made.
"""

from __future__ import annotations


import torch

from .autograd import LocalStats


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` on operands in ``dtype`` (the model's precision) with a float32 result."""
    a, b = a.to(dtype), b.to(dtype)
    if dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return a.float() @ b.float()


def _chunk_logits(x, weight, coef, start, end):
    z = _mm(x[start:end], weight.t(), x.dtype)
    return z.mul_(coef[start:end].unsqueeze(1))


class TorchChunked:
    name = "torch"

    @staticmethod
    def local_stats(x, weight, coef, local_label, chunk_size) -> LocalStats:
        n = x.shape[0]
        f32 = dict(dtype=torch.float32, device=x.device)
        m, s, a, t = (torch.empty(n, **f32) for _ in range(4))
        owned = local_label >= 0
        index = local_label.clamp(min=0).unsqueeze(1)  # gather at a safe index, then mask: no sync
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _chunk_logits(x, weight, coef, start, end)
            t[start:end] = torch.where(owned[start:end], z.gather(1, index[start:end]).squeeze(1), 0.0)
            zmax = z.amax(dim=1)
            m[start:end] = zmax
            z.sub_(zmax.unsqueeze(1))  # l - m_loc <= 0
            e = torch.exp(z)
            s[start:end] = e.sum(dim=1)
            a[start:end] = (e * z).sum(dim=1)
            del z, e
        return LocalStats(m, s, a, t)

    @staticmethod
    def grads(x, weight, coef, local_label, logz, entropy, g1, g2, chunk_size, need_x, need_w):
        n = x.shape[0]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        owned = local_label >= 0
        index = local_label.clamp(min=0).unsqueeze(1)
        g_target = torch.where(owned, g1, 0.0).unsqueeze(1)
        # dL/dl_j = -p_j (g1 + g2 (log p_j + H)) + g1 1[j = y]; then dz = coef * dl
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _chunk_logits(x, weight, coef, start, end)
            z.sub_(logz[start:end].unsqueeze(1))  # log p
            p = torch.exp(z)
            z.add_(entropy[start:end].unsqueeze(1)).mul_(g2[start:end].unsqueeze(1))
            z.add_(g1[start:end].unsqueeze(1)).mul_(p).neg_()
            del p
            z.scatter_add_(1, index[start:end], g_target[start:end])
            z.mul_(coef[start:end].unsqueeze(1))
            if need_x:
                dx[start:end] = _mm(z, weight, x.dtype)
            if need_w:
                dw += _mm(z.t(), x[start:end], x.dtype)
            del z
        return dx, (dw.to(weight.dtype) if need_w else None)
