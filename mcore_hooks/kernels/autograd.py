"""The autograd function shared by every backend: communication and the statistics' algebra.

A backend supplies two passes over this rank's vocabulary shard (see :class:`Backend`):
``local_stats`` (forward: per-token max, sum-exp, entropy term and target logit of the local
logits) and ``grads`` (backward: recompute the logits, form their gradient, return dX and dW).
This module combines shards across the tensor-parallel group (one MAX and one SUM all-reduce for
the whole batch), gathers sequence-parallel hidden states once, and reduces their gradient once
(all-reduce, or reduce-scatter under sequence parallelism), so the backends stay pure math.

Per token, with ``l = coef * (x @ W.T)`` (``coef = logit_scale / temperature``) over the full
vocabulary, ``m = max l``, ``s = sum exp(l - m)``, ``logZ = m + log s``, ``p = exp(l - logZ)``:

* ``logprob = (l[y] - m) - log s``: ``m`` and ``log s`` stay apart, as in ``log_softmax``, because
  ``logZ`` rounded to float32 is off by half an ulp of the largest logit, which ``p`` would inherit;
* ``entropy = log s - sum(exp(l - m) * (l - m)) / s`` — each term is taken relative to the max,
  so it stays exact when all logits are hugely negative or hugely positive;
* ``d logprob / d l_j = 1[j = y] - p_j``; ``d entropy / d l_j = -p_j (log p_j + entropy)``.

:class:`LinearCrossEntropy` is the reduced loss ``sum_i w_i (logZ_i - l_i[y_i])``. Its upstream
gradient is one scalar, so the logit gradients can be formed in the forward while each token
chunk's logits exist (3 matmuls, 6NHV, instead of recomputing them: 8NHV); the backward only
scales dX and dW by that scalar. Backends supply the row passes over a chunk's materialised fp32
logits (``ce_row_stats``, ``ce_row_grad``); the products are cuBLAS (:mod:`.matmul`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from ..compat import group_rank_size
from .matmul import addmm_f32_, mm_f32


class LocalStats(NamedTuple):
    """Float32 ``[N]`` statistics of this rank's logits: ``m_loc``, ``sum exp(l - m_loc)``,
    ``sum exp(l - m_loc) * (l - m_loc)`` and the label's logit (0 where not owned)."""

    max: torch.Tensor
    sumexp: torch.Tensor
    plogp: torch.Tensor
    target: torch.Tensor


class Backend(Protocol):
    def local_stats(
        self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor,
        chunk_size: int,
    ) -> LocalStats: ...

    def grads(
        self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor,
        m: torch.Tensor, log_s: torch.Tensor, entropy: torch.Tensor, g_logprob: torch.Tensor,
        g_entropy: torch.Tensor, chunk_size: int, need_x: bool, need_w: bool,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]: ...

    def ce_row_stats(
        self, z: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor
    ) -> LocalStats: ...

    def ce_row_grad(
        self, z: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor, m: torch.Tensor,
        log_s: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
    ) -> torch.Tensor: ...


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-parallel all-gather along tokens, allocating on ``x``'s device."""
    world = group_rank_size(group)[1]
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.chunk(world)), x.contiguous(), group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, keep this rank's token shard (the sequence-parallel dgrad reduction)."""
    rank, world = group_rank_size(group)
    if x.device.type == "cpu":  # gloo has no reduce_scatter: all-reduce, then slice
        dist.all_reduce(x, group=group)
        return x.chunk(world)[rank].clone()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def rescaled(stats: LocalStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sumexp`` and ``plogp`` of ``stats`` re-expressed relative to ``new_max`` (>= its max),
    so partial statistics over disjoint vocab ranges can be added."""
    shift = stats.max - new_max
    alpha = torch.exp(shift)
    return stats.sumexp * alpha, (stats.plogp + shift * stats.sumexp) * alpha


def merge_partials(parts: LocalStats) -> LocalStats:
    """Statistics stacked over disjoint vocab ranges (dim 0) -> statistics of their union."""
    m = parts.max.amax(dim=0)
    s, a = rescaled(parts, m)
    return LocalStats(m, s.sum(dim=0), a.sum(dim=0), parts.target.sum(dim=0))


class GlobalStats(NamedTuple):
    """Float32 ``[N]`` statistics of the full vocabulary: ``logZ = max + log_s``, kept in two
    parts (see the module docstring), the entropy, and the label's logit."""

    max: torch.Tensor
    log_s: torch.Tensor
    entropy: torch.Tensor
    target: torch.Tensor

    def logprob(self) -> torch.Tensor:
        return (self.target - self.max) - self.log_s


def combine(stats: LocalStats, group) -> GlobalStats:
    """Shard statistics -> global statistics: one MAX, one SUM all-reduce."""
    gmax = all_reduce(stats.max.clone(), dist.ReduceOp.MAX, group)
    summed = torch.stack([*rescaled(stats, gmax), stats.target])
    all_reduce(summed, dist.ReduceOp.SUM, group)
    s, a, target = summed[0], summed[1], summed[2]
    log_s = torch.log(s)
    return GlobalStats(gmax, log_s, log_s - a / s, target)


def label_is_row_max(stats: GlobalStats) -> torch.Tensor:
    """Whether each token's label logit is the largest of its row (the label is the argmax):
    MTP acceptance. The label's logit may be summed in another order than the row's maximum
    (the Triton backend's separate dot), so equality is taken to 8 float32 ulps of the maximum."""
    return stats.target >= stats.max - stats.max.abs().clamp(min=1.0) * 2.0**-20


def local_labels(labels, valid, vocab_start: int, v_local: int) -> torch.Tensor:
    """Labels as rows of this rank's shard; -1 where the rank does not own the label (or the
    position is ignored)."""
    local = labels - vocab_start
    return torch.where((local >= 0) & (local < v_local) & valid, local, -1)


def reduce_hidden_grad(dx: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The one reduction of the hidden states' gradient: reduce-scatter under sequence
    parallelism, else all-reduce (each rank saw only its vocab shard)."""
    if sequence_parallel:
        return reduce_scatter_tokens(dx, group)
    return all_reduce(dx, dist.ReduceOp.SUM, group)


class LinearLogSoftmaxStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, valid, vocab_start, group, sequence_parallel,
                chunk_size, backend):
        x = gather_tokens(hidden, group) if sequence_parallel else hidden
        local_label = local_labels(labels, valid, vocab_start, weight.shape[0])
        st = combine(backend.local_stats(x, weight, coef, local_label, chunk_size), group)
        logprob = torch.where(valid, st.logprob(), 0.0)
        entropy = torch.where(valid, st.entropy, 0.0)
        logz = st.max + st.log_s
        label_is_argmax = valid & label_is_row_max(st)
        ctx.save_for_backward(x, weight, local_label, coef, valid, st.max, st.log_s, entropy)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.chunk_size, ctx.backend, ctx.hidden_shape = chunk_size, backend, hidden.shape
        ctx.mark_non_differentiable(logz, label_is_argmax)
        return logprob, entropy, logz, label_is_argmax

    @staticmethod
    def backward(ctx, d_logprob, d_entropy, _d_logz, _d_argmax):
        x, weight, local_label, coef, valid, m, log_s, entropy = ctx.saved_tensors
        zero = torch.zeros_like(m)
        g1 = torch.where(valid, d_logprob.float(), zero) if d_logprob is not None else zero
        g2 = torch.where(valid, d_entropy.float(), zero) if d_entropy is not None else zero
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = ctx.backend.grads(
            x, weight, coef, local_label, m, log_s, entropy, g1, g2, ctx.chunk_size, need_x, need_w
        )
        if dx is not None:
            dx = reduce_hidden_grad(dx, ctx.group, ctx.sequence_parallel).view(ctx.hidden_shape)
        return dx, dw, None, None, None, None, None, None, None, None


class LinearCrossEntropy(torch.autograd.Function):
    """``sum_i token_weight_i * (logZ_i - l_i[y_i])`` over valid tokens, gradients formed in the
    forward. dX and dW are kept in float32 until the backward scales them by the upstream
    gradient, so each is rounded to the input dtype once, as the stock single matmul rounds it."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, token_weight, valid, vocab_start, group,
                sequence_parallel, chunk_size, backend, need_x, need_w):
        x = gather_tokens(hidden, group) if sequence_parallel else hidden
        n, v_local = x.shape[0], weight.shape[0]
        local_label = local_labels(labels, valid, vocab_start, v_local)
        tw = torch.where(valid, token_weight.float(), 0.0)
        scale = tw * coef  # d loss / d raw logit = tw * coef * (p - onehot)
        f32 = dict(dtype=torch.float32, device=x.device)
        loss = torch.zeros(n, **f32)
        dx = torch.empty((n, x.shape[1]), **f32) if need_x else None
        dw = torch.empty(weight.shape, **f32) if need_w else None
        # dz holds `chunk_size` tokens (the K of each dW product: fewer passes over the fp32
        # accumulator); their fp32 logits are made half a chunk at a time.
        c = min(chunk_size, n)
        cz = -(-c // 2)
        z = torch.empty((cz, v_local), **f32)
        dz = torch.empty((c, v_local), dtype=x.dtype, device=x.device)
        for start in range(0, n, c):
            end = min(start + c, n)
            for s0 in range(start, end, cz):
                s1 = min(s0 + cz, end)
                rows, zc = slice(s0, s1), z[: s1 - s0]
                mm_f32(x[rows], weight.t(), out=zc)
                st = combine(backend.ce_row_stats(zc, coef[rows], local_label[rows]), group)
                loss[rows] = tw[rows] * -st.logprob()
                backend.ce_row_grad(zc, coef[rows], local_label[rows], st.max, st.log_s,
                                    scale[rows], dz[s0 - start : s1 - start])
            xc, dzc = x[start:end], dz[: end - start]
            if need_x:
                mm_f32(dzc, weight, out=dx[start:end])
            if need_w:
                if start == 0:
                    mm_f32(dzc.t(), xc, out=dw)
                else:
                    addmm_f32_(dw, dzc.t(), xc)
        del z, dz
        ctx.save_for_backward(dx, dw)
        ctx.group, ctx.sequence_parallel, ctx.hidden_shape = group, sequence_parallel, hidden.shape
        ctx.dtype = x.dtype
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        dx32, dw32 = ctx.saved_tensors
        dx = dw = None
        if dx32 is not None:
            dx = torch.mul(dx32, grad, out=torch.empty(dx32.shape, dtype=ctx.dtype, device=dx32.device))
            dx = reduce_hidden_grad(dx, ctx.group, ctx.sequence_parallel).view(ctx.hidden_shape)
        if dw32 is not None:
            dw = torch.mul(dw32, grad, out=torch.empty(dw32.shape, dtype=ctx.dtype, device=dw32.device))
        return dx, dw, *([None] * 11)
