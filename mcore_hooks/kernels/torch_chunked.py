"""PyTorch backend: chunked linear + log-softmax statistics with a recomputing backward.

Runs on CPU and GPU. The forward walks the tokens in chunks of ``chunk_size``: each chunk's logits
``[chunk, V_local]`` are made in float32 (never rounded to bf16/fp16), reduced to four numbers per
token, and dropped. After all chunks, two collectives over the tensor-parallel group combine the
vocab shards (a MAX of the local maxima, then one SUM of the rescaled statistics). The backward
recomputes each chunk's logits from the saved hidden states and weight, forms the logit gradient of
log-prob and entropy directly, and accumulates dX and dW; no tensor larger than one chunk's
``[chunk, V_local]`` logits (or the weight and hidden states themselves) is ever made.

Per token, with ``l = scale * (x @ W.T) / T`` over the full (all-rank) vocabulary, ``m = max l``,
``s = sum exp(l - m)``, ``logZ = m + log s``, ``p = exp(l - logZ)``:

* ``logprob = l[y] - logZ``
* ``entropy = log s - sum(exp(l - m) * (l - m)) / s`` — every term is <= 0 relative to the max, so
  it stays exact when all logits are hugely negative or hugely positive.
* ``d logprob / d l_j = 1[j = y] - p_j``; ``d entropy / d l_j = -p_j (log p_j + entropy)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .options import VocabParallel


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` on operands in ``dtype`` (the model's precision) with a float32 result.

    bf16/fp16 products accumulate in fp32 and are never rounded back (stock rounds logits to bf16).
    """
    a, b = a.to(dtype), b.to(dtype)
    if dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return a.float() @ b.float()


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-parallel all-gather along tokens, allocating on ``x``'s device."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.chunk(world)), x.contiguous(), group=group)
    return out


def _reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, keep this rank's token shard (the sequence-parallel dgrad reduction)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # gloo has no reduce_scatter; an all-reduce then a slice gives the same sums.
    if x.device.type == "cpu":
        dist.all_reduce(x, group=group)
        return x.chunk(world)[rank].clone()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _scaled_logits(x, weight, scale, temp, start, end):
    z = _mm(x[start:end], weight.t(), x.dtype)
    z.mul_((scale / temp[start:end]).unsqueeze(1))
    return z


class _LinearLogSoftmaxStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: torch.Tensor,
        valid: torch.Tensor,
        scale: float,
        vocab_start: int,
        group,
        sequence_parallel: bool,
        chunk_size: int,
    ):
        x = _gather_tokens(hidden, group) if sequence_parallel else hidden
        n, v_local = x.shape[0], weight.shape[0]
        dev = x.device
        local_max = torch.empty(n, dtype=torch.float32, device=dev)
        sumexp = torch.empty(n, dtype=torch.float32, device=dev)
        plogp = torch.empty(n, dtype=torch.float32, device=dev)  # sum exp(l-m_loc) * (l-m_loc)
        target = torch.zeros(n, dtype=torch.float32, device=dev)
        local_label = labels - vocab_start
        owned = (local_label >= 0) & (local_label < v_local) & valid
        # Gather/scatter at a clamped index, masked by `owned`: no host sync per chunk.
        index = local_label.clamp(0, v_local - 1).unsqueeze(1)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _scaled_logits(x, weight, scale, temperature, start, end)
            m = z.amax(dim=1)
            local_max[start:end] = m
            picked = z.gather(1, index[start:end]).squeeze(1)
            target[start:end] = torch.where(owned[start:end], picked, 0.0)
            z.sub_(m.unsqueeze(1))  # z <- l - m_loc  (<= 0)
            e = torch.exp(z)
            sumexp[start:end] = e.sum(dim=1)
            plogp[start:end] = (e * z).sum(dim=1)
            del z, e
        # Combine vocab shards: global max, then rescale each shard's sums to it and add.
        gmax = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        alpha = torch.exp(local_max - gmax)
        shift = local_max - gmax
        stats = torch.stack([sumexp * alpha, (plogp + shift * sumexp) * alpha, target])
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        s, a, target = stats[0], stats[1], stats[2]
        log_s = torch.log(s)
        logz = gmax + log_s
        logprob = torch.where(valid, target - logz, torch.zeros_like(target))
        entropy = torch.where(valid, log_s - a / s, torch.zeros_like(target))
        ctx.save_for_backward(x, weight, labels, temperature, valid, logz, entropy)
        ctx.scale, ctx.vocab_start, ctx.group = scale, vocab_start, group
        ctx.sequence_parallel, ctx.chunk_size = sequence_parallel, chunk_size
        ctx.hidden_shape = hidden.shape
        ctx.mark_non_differentiable(logz)
        return logprob, entropy, logz

    @staticmethod
    def backward(ctx, d_logprob, d_entropy, _d_logz):
        x, weight, labels, temperature, valid, logz, entropy = ctx.saved_tensors
        n, v_local = x.shape[0], weight.shape[0]
        dev = x.device
        zero = torch.zeros(n, dtype=torch.float32, device=dev)
        g1 = torch.where(valid, d_logprob.float(), zero) if d_logprob is not None else zero
        g2 = torch.where(valid, d_entropy.float(), zero) if d_entropy is not None else zero
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        local_label = labels - ctx.vocab_start
        owned = (local_label >= 0) & (local_label < v_local) & valid
        index = local_label.clamp(0, v_local - 1).unsqueeze(1)
        g_target = torch.where(owned, g1, zero).unsqueeze(1)
        # dL/dl_j = g1 (1[j=y] - p_j) - g2 p_j (log p_j + H) = -p_j (g1 + g2 (log p_j + H)) + g1 1[j=y]
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            z = _scaled_logits(x, weight, ctx.scale, temperature, start, end)
            z.sub_(logz[start:end].unsqueeze(1))  # log p
            p = torch.exp(z)
            z.add_(entropy[start:end].unsqueeze(1)).mul_(g2[start:end].unsqueeze(1))
            z.add_(g1[start:end].unsqueeze(1)).mul_(p).neg_()
            del p
            z.scatter_add_(1, index[start:end], g_target[start:end])
            # chain rule through l = scale * z_raw / T
            z.mul_((ctx.scale / temperature[start:end]).unsqueeze(1))
            if need_x:
                dx[start:end] = _mm(z, weight, x.dtype)
            if need_w:
                dw += _mm(z.t(), x[start:end], x.dtype)
            del z
        d_hidden = None
        if need_x:
            group = ctx.group
            if ctx.sequence_parallel:
                d_hidden = _reduce_scatter_tokens(dx, group)
            else:
                d_hidden = _all_reduce(dx, dist.ReduceOp.SUM, group)
            d_hidden = d_hidden.view(ctx.hidden_shape)
        d_weight = dw.to(weight.dtype) if need_w else None
        return d_hidden, d_weight, None, None, None, None, None, None, None, None


def linear_log_softmax_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    valid: torch.Tensor,
    *,
    scale: float,
    parallel: VocabParallel,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(logprob, entropy, logZ)``, float32 ``[N]``, differentiable in hidden and weight.

    ``hidden`` is ``[N, H]`` (this rank's ``[N/tp, H]`` token shard when
    ``parallel.sequence_parallel``), ``weight`` this rank's ``[V_local, H]`` vocab shard, ``labels``
    global ids ``[N]``, ``temperature`` ``[N]`` float32, ``valid`` ``[N]`` bool (False: output 0, no
    gradient). Inputs are validated by the caller (:mod:`mcore_hooks.kernels`).
    """
    group = parallel.group if parallel.group is not None and dist.is_initialized() else None
    return _LinearLogSoftmaxStats.apply(
        hidden, weight, labels, temperature, valid, float(scale), int(parallel.vocab_start),
        group, bool(parallel.sequence_parallel and group is not None), int(chunk_size),
    )
