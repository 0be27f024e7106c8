"""The tensor-parallel group's communication the passes share: a sum or maximum over the group
(in rank order where batch invariance asks), the sequence-parallel all-gather of the hidden
states and the reduction of their gradient, on plain tensors and process groups."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_size(group) -> tuple[int, int]:
    """This process's rank in ``group`` and its size; ``(0, 1)`` for None (not split) or without
    torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group, ordered: bool = False) -> torch.Tensor:
    """``t`` reduced over the group in place. ``ordered`` (batch invariance): a sum over more
    than two ranks is added in rank order (:func:`_slice_in_rank_order`, then an all-gather:
    an all-reduce's traffic); the order of a collective's own sum depends on the message's
    size and the element's place in it. A maximum, or a sum of two (``a + b == b + a``), is
    the same in any order."""
    world = group_rank_size(group)[1]
    if ordered and world > 2 and op == dist.ReduceOp.SUM:
        flat = t.reshape(-1)
        pad = -flat.numel() % world
        mine = _slice_in_rank_order(torch.cat([flat, flat.new_zeros(pad)]) if pad else flat, group)
        whole = torch.empty((world * mine.numel(),), dtype=t.dtype, device=t.device)
        _all_gather_into(whole, mine, group)
        t.copy_(whole[: flat.numel()].view(t.shape))
    elif world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _slice_in_rank_order(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of ``t`` (split along dim 0 into the group's size, equal parts) summed
    over the group in rank order: an all-to-all brings it every rank's term (the traffic and
    memory of a reduce-scatter), added in float32 in rank order and rounded once."""
    world = group_rank_size(group)[1]
    terms = torch.empty_like(t, memory_format=torch.contiguous_format)
    dist.all_to_all_single(terms, t.contiguous(), group=group)
    terms = terms.view((world, -1) + tuple(t.shape[1:]))
    out = terms[0].to(torch.float32, copy=True)  # this rank's slice alone stays alive
    for term in terms[1:]:
        out.add_(term)
    return out.to(t.dtype)


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-parallel all-gather along tokens, allocating on ``x``'s device."""
    world = group_rank_size(group)[1]
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(out, x.contiguous(), group)
    return out


def _all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """``out`` (contiguous, ``world`` times ``t`` along dim 0) = every rank's ``t`` in rank order:
    NCCL's single-buffer all-gather (a list of views costs a copy into each, and their launches,
    on the host's hot path of small calls); gloo's list form elsewhere."""
    world = group_rank_size(group)[1]
    if t.device.type == "cuda" and dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, t, group=group)
    else:
        dist.all_gather([part.view(t.shape) for part in out.chunk(world)], t, group=group)


def gather_columns(t: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``[N, k]`` along the columns: ``[N, world * k]``, rank-major."""
    world = group_rank_size(group)[1]
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_tokens(x: torch.Tensor, group, ordered: bool = False) -> torch.Tensor:
    """Sum over ranks, keep this rank's token shard (the sequence-parallel dgrad reduction);
    ``ordered`` as :func:`all_reduce`'s."""
    rank, world = group_rank_size(group)
    if ordered and world > 2:
        return _slice_in_rank_order(x, group)
    if x.device.type == "cpu" or dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter:
        # all-reduce a copy, then slice (gloo also takes CUDA tensors: ranks sharing one GPU)
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x.chunk(world)[rank].clone()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def reduce_hidden_grad(dx: torch.Tensor, group, sequence_parallel: bool,
                       ordered: bool = False) -> torch.Tensor:
    """The one reduction of the hidden states' gradient: reduce-scatter under sequence
    parallelism, else all-reduce (each rank saw only its vocab shard); ``ordered`` as
    :func:`all_reduce`'s."""
    if sequence_parallel:
        return reduce_scatter_tokens(dx, group, ordered)
    return all_reduce(dx, dist.ReduceOp.SUM, group, ordered)
