"""The autograd function shared by every backend: communication and the statistics' algebra.

A backend supplies two passes over this rank's vocabulary shard (see :class:`Backend`):
``local_stats`` (forward: per-token max, sum-exp, entropy term and target logit of the local
logits) and ``grads`` (backward: recompute the logits, form their gradient, return dX and dW).
This module combines shards across the tensor-parallel group (one MAX and one SUM all-reduce for
the whole batch), gathers sequence-parallel hidden states once, and reduces their gradient once
(all-reduce, or reduce-scatter under sequence parallelism), so the backends stay pure math.

Per token, with ``l = coef * (x @ W.T)`` (``coef = logit_scale / temperature``) over the full
vocabulary, ``m = max l``, ``s = sum exp(l - m)``, ``logZ = m + log s``, ``p = exp(l - logZ)``:

* ``logprob = l[y] - logZ``
* ``entropy = log s - sum(exp(l - m) * (l - m)) / s`` — each term is taken relative to the max,
  so it stays exact when all logits are hugely negative or hugely positive;
* ``d logprob / d l_j = 1[j = y] - p_j``; ``d entropy / d l_j = -p_j (log p_j + entropy)``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist


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
        logz: torch.Tensor, entropy: torch.Tensor, g_logprob: torch.Tensor, g_entropy: torch.Tensor,
        chunk_size: int, need_x: bool, need_w: bool,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]: ...


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-parallel all-gather along tokens, allocating on ``x``'s device."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.chunk(world)), x.contiguous(), group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, keep this rank's token shard (the sequence-parallel dgrad reduction)."""
    world = dist.get_world_size(group)
    if x.device.type == "cpu":  # gloo has no reduce_scatter: all-reduce, then slice
        dist.all_reduce(x, group=group)
        return x.chunk(world)[dist.get_rank(group)].clone()
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


def combine(stats: LocalStats, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shard statistics -> global ``(logZ, entropy, target logit)``: one MAX, one SUM all-reduce."""
    gmax = all_reduce(stats.max.clone(), dist.ReduceOp.MAX, group)
    summed = torch.stack([*rescaled(stats, gmax), stats.target])
    all_reduce(summed, dist.ReduceOp.SUM, group)
    s, a, target = summed[0], summed[1], summed[2]
    log_s = torch.log(s)
    return gmax + log_s, log_s - a / s, target


class LinearLogSoftmaxStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, valid, vocab_start, group, sequence_parallel,
                chunk_size, backend):
        x = gather_tokens(hidden, group) if sequence_parallel else hidden
        v_local = weight.shape[0]
        local_label = labels - vocab_start
        # -1 where this rank does not own the label (or the position is ignored)
        local_label = torch.where(
            (local_label >= 0) & (local_label < v_local) & valid, local_label, -1
        )
        logz, entropy, target = combine(
            backend.local_stats(x, weight, coef, local_label, chunk_size), group
        )
        zero = torch.zeros_like(target)
        logprob = torch.where(valid, target - logz, zero)
        entropy = torch.where(valid, entropy, zero)
        ctx.save_for_backward(x, weight, local_label, coef, valid, logz, entropy)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.chunk_size, ctx.backend, ctx.hidden_shape = chunk_size, backend, hidden.shape
        ctx.mark_non_differentiable(logz)
        return logprob, entropy, logz

    @staticmethod
    def backward(ctx, d_logprob, d_entropy, _d_logz):
        x, weight, local_label, coef, valid, logz, entropy = ctx.saved_tensors
        zero = torch.zeros_like(logz)
        g1 = torch.where(valid, d_logprob.float(), zero) if d_logprob is not None else zero
        g2 = torch.where(valid, d_entropy.float(), zero) if d_entropy is not None else zero
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = ctx.backend.grads(
            x, weight, coef, local_label, logz, entropy, g1, g2, ctx.chunk_size, need_x, need_w
        )
        if dx is not None:
            if ctx.sequence_parallel:
                dx = reduce_scatter_tokens(dx, ctx.group)
            else:
                dx = all_reduce(dx, dist.ReduceOp.SUM, ctx.group)
            dx = dx.view(ctx.hidden_shape)
        return dx, dw, None, None, None, None, None, None, None, None
