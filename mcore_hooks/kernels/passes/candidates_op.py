"""Given ids' logits and a truncation's top-k as custom ops (see :mod:`.ops`):
``candidate_logits`` and its backward, :func:`logits_of`, ``top_k_ids``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..common import autograd as ag
from ..common import guards
from ..common import comm
from . import candidates as cand
from ..common.dispatch import call, custom_op, register_autograd
from ..common.invariant import block_rows, blocks, padded, tiling_chunk
from .ops import _F32, _backend, _fake_group_size, _group, _nothing, group_name, invariant
from ..common.options import KernelParams
from ..torch_backend.torch_chunked import TorchChunked

@custom_op("mcore_hooks::candidate_logits", mutates_args=())
def candidate_logits(
    hidden: Tensor, weight: Tensor, ids: Tensor, coef: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, accumulator: Optional[Tensor],
    placeholder: bool, backend: str, compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(logits, gathered hidden)``: float32 ``[N, K]`` logits of ``ids`` (global, -1 padding:
    0 there), the same on every rank of the group; the gathered hidden states (sequence
    parallelism, else empty) are for the backward, as ``accumulator`` and ``placeholder``.
    ``backend``: whose gathered dot products to use (``Backend.gathered_dots``); ``compiled``
    as :func:`logsoftmax_stats`'s."""
    if accumulator is not None and compiled:
        guards.check_accumulator_kept()
    pg = _group(group)
    x = comm.gather_tokens(hidden, pg) if sequence_parallel else hidden
    logits = cand.candidate_logits(x, weight, coef, ids, vocab_start, chunk_size, invariant(backend),
                                   _backend(backend, hidden.device).gathered_dots)
    # each id owned by one rank: exact (ordered all the same, as the statistics op's)
    comm.all_reduce(logits, torch.distributed.ReduceOp.SUM, pg, invariant(backend))
    return logits, (x if sequence_parallel else _nothing(hidden))


@candidate_logits.register_fake
def _(hidden, weight, ids, coef, vocab_start, group, sequence_parallel, chunk_size, accumulator,
      placeholder, backend, compiled=False):
    x = hidden.new_empty((ids.shape[0], hidden.shape[1])) if sequence_parallel else _nothing(hidden)
    return hidden.new_empty(ids.shape, dtype=_F32), x


@custom_op("mcore_hooks::candidate_logits_backward", mutates_args=("accumulator",))
def candidate_logits_backward(
    x: Tensor, weight: Tensor, ids: Tensor, coef: Tensor, vocab_start: int, group: Optional[str],
    sequence_parallel: bool, chunk_size: int, d_logits: Tensor, need_x: bool, need_w: bool,
    accumulator: Optional[Tensor], invariant: bool,
) -> tuple[Tensor, Tensor]:
    """``(dX, dW)`` of ``sum d_logits * logits`` (dX in the input dtype, reduced over the group,
    this rank's shard under sequence parallelism); empty where not asked for, or dW where it
    went into ``accumulator``."""
    dx, dw = cand.candidate_grads(x, weight, coef, ids, vocab_start, d_logits, chunk_size, need_x,
                                  need_w, accumulator if need_w else None, invariant)
    if dx is not None:
        dx = comm.reduce_hidden_grad(dx.to(x.dtype), _group(group), sequence_parallel, invariant)
    return (_nothing(x) if dx is None else dx), (_nothing(weight) if dw is None else dw)


@candidate_logits_backward.register_fake
def _(x, weight, ids, coef, vocab_start, group, sequence_parallel, chunk_size, d_logits, need_x,
      need_w, accumulator, invariant):
    rows = x.shape[0] // _fake_group_size(group) if sequence_parallel else x.shape[0]
    dx = x.new_empty((rows, x.shape[1])) if need_x else _nothing(x)
    dw = weight.new_empty(weight.shape) if need_w and accumulator is None else _nothing(weight)
    return dx, dw


def _candidate_setup(ctx, inputs, output):
    (hidden, weight, ids, coef, vocab_start, group, sp, chunk_size, accumulator, placeholder,
     backend) = inputs[:11]
    logits, gathered = output
    ctx.mark_non_differentiable(gathered)
    ctx.set_materialize_grads(False)
    # the logits: first_order's anchor (an output, attached to the inputs through this node)
    ctx.save_for_backward(gathered if sp else hidden, weight, ids, coef, logits)
    ctx.args = (vocab_start, group, sp, chunk_size)
    ctx.accumulator = accumulator  # not saved: written by other backwards by design (as above)
    ctx.invariant = invariant(backend)
    ctx.hidden_shape, ctx.placeholder = hidden.shape, placeholder


def _candidate_backward(ctx, d_logits, _):
    if d_logits is None:
        return (None,) * 12
    x, weight, ids, coef, logits = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    acc = ctx.accumulator if need_w else None
    with torch.no_grad():  # first_order below refuses a double backward (as the statistics')
        dx, dw = call(candidate_logits_backward, x, weight, ids, coef, *ctx.args, d_logits.float(), need_x,
                      need_w, acc, ctx.invariant)
    dx = dx.view(ctx.hidden_shape) if need_x else None
    if acc is not None:
        dw = guards.placeholder_grad_like(weight.shape, weight.dtype, weight.device) if ctx.placeholder else None
    elif not need_w:
        dw = None
    return guards.first_order("the kept-set logits (linear_logprob_entropy)", dx, dw, anchor=logits,
                              why="its gradients are made by operations that are not differentiated") + (None,) * 10


register_autograd(candidate_logits, _candidate_backward, _candidate_setup)


def logits_of(hidden: Tensor, weight: Tensor, ids: Tensor, p: KernelParams) -> Tensor:
    """Float32 ``[N, K]`` logits of ``ids`` through the op, differentiable in ``hidden`` and
    ``weight`` (the weight's gradient into ``p.weight_grad_accumulator`` where one is given)."""
    chunk = cand.gather_chunk_size(ids.shape[1], hidden.shape[1])
    return call(candidate_logits, hidden, weight, ids, p.coef, p.vocab_start, group_name(p.group),
                p.sequence_parallel, chunk, p.weight_grad_accumulator, p.dummy_weight_grad,
                p.backend, torch.compiler.is_compiling())[0]


@custom_op("mcore_hooks::top_k_ids", mutates_args=())
def top_k_ids(
    hidden: Tensor, weight: Tensor, coef: Tensor, vocab_start: int, group: Optional[str],
    sequence_parallel: bool, chunk_size: int, top_k: int, invariant: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(values, ids, max, log_s)``: each token's ``top_k`` largest float32 logits over the
    whole vocabulary and their global ids ``[N, top_k]``, and the vocabulary's statistics
    ``[N]`` (``logZ = max + log_s``; no gradient), from the torch backend's statistics pass
    (its chunks of materialised logits; Triton's fused tiles keep no logits to rank), then
    merged over the group."""
    pg = _group(group)
    x = comm.gather_tokens(hidden, pg) if sequence_parallel else hidden
    n = x.shape[0]
    none = torch.full((n,), -1, dtype=torch.long, device=x.device)
    if invariant:  # fixed-shape blocks, as InvariantBlocks runs the statistics pass
        b = block_rows(x.device)
        parts = [TorchChunked.local_stats_top_k(padded(x[s:e], b, 0), weight,
                                                padded(coef[s:e], b, 1.0),
                                                padded(none[s:e], b, -1), tiling_chunk(chunk_size, b),
                                                top_k, aligned=True)
                 for s, e in blocks(n, b)]
        real = [e - s for s, e in blocks(n, b)]  # each block's rows before its padding
        local = ag.LocalStats(*[torch.cat([st[i][:r] for (st, _), r in zip(parts, real)]) for i in range(4)])
        values = torch.cat([v[:r] for (_, (v, _)), r in zip(parts, real)])
        rows = torch.cat([i[:r] for (_, (_, i)), r in zip(parts, real)])
    else:
        local, (values, rows) = TorchChunked.local_stats_top_k(x, weight, coef, none, chunk_size, top_k)
    st = ag.combine(local, pg, invariant)
    ids = rows + vocab_start
    if comm.group_rank_size(pg)[1] > 1:
        values, ids = comm.gather_columns(values, pg), comm.gather_columns(ids, pg)
        values, where = values.topk(min(top_k, values.shape[1]), dim=1)
        ids = ids.gather(1, where)
    return values, ids, st.max, st.log_s


@top_k_ids.register_fake
def _(hidden, weight, coef, vocab_start, group, sequence_parallel, chunk_size, top_k, invariant):
    n = coef.shape[0]
    k = min(top_k, weight.shape[0] * _fake_group_size(group))
    f32 = [hidden.new_empty(n, dtype=_F32) for _ in range(2)]
    return hidden.new_empty((n, k), dtype=_F32), hidden.new_empty((n, k), dtype=torch.long), f32[0], f32[1]
