"""The log-prob/entropy pass as a custom op (see :mod:`.ops`): ``logsoftmax_stats``, its backward
``logsoftmax_stats_backward``, and :func:`stats`, the pass through them."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..common import guards
from ..common import comm
from . import candidates as cand
from ..common.dispatch import call, custom_op, register_autograd, tracing
from .ops import _F32, _backend, _fake_group_size, _group, _nothing, group_name, invariant
from ..common.options import KernelParams

@custom_op("mcore_hooks::logsoftmax_stats", mutates_args=())
def logsoftmax_stats(
    hidden: Tensor, weight: Tensor, labels: Tensor, valid: Tensor, coef: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, backend: str,
    accumulator: Optional[Tensor], placeholder: bool, extra_ids: Optional[Tensor] = None,
    compiled: bool = False, floor: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logprob, entropy, logz, label_is_argmax, max, log_s, gathered hidden, extra logits)``
    per token (``labels``: this rank's local rows, ``KernelParams.local_labels``); max, log_s
    and the gathered hidden states (only under sequence parallelism, else empty) are for the
    backward. ``extra_ids`` (``[N, K]`` global ids, -1 padding): their
    float32 logits, differentiable, their gradient folded into this pass's backward like the
    label's (empty without). ``accumulator`` and ``placeholder`` are for the backward alone
    (where the weight's gradient goes; whether the weight then gets a zero-stride placeholder).
    ``compiled``: traced by ``torch.compile`` (where the accumulator is one of the graph's
    saved tensors: :func:`~..common.guards.check_accumulator_kept`). ``floor`` (``[N, 2]``, the torch
    backend's): the distribution renormalised over each token's kept set given as a floor
    (:mod:`..kept_sets.nucleus`), never made as ``[N, V]``."""
    if accumulator is not None and compiled:
        guards.check_accumulator_kept()
    pg = _group(group)
    x = comm.gather_tokens(hidden, pg) if sequence_parallel else hidden
    impl = _backend(backend, hidden.device)
    fl = {} if floor is None else {"floor": floor}
    logprob, entropy, logz, best, m, log_s = impl.stats(x, weight, coef, labels, valid,
                                                        chunk_size, pg, invariant(backend), **fl)
    extra = _nothing(coef)
    if extra_ids is not None:
        extra = cand.candidate_logits(x, weight, coef, extra_ids, vocab_start,
                                      cand.gather_chunk_size(extra_ids.shape[1], x.shape[1]),
                                      invariant(backend), impl.gathered_dots)
        # each id on one rank: exact in any order (ordered all the same: with batch invariance
        # no sum over more than two ranks is left to a collective's order)
        comm.all_reduce(extra, torch.distributed.ReduceOp.SUM, pg, invariant(backend))
    return (logprob, entropy, logz, best, m, log_s, x if sequence_parallel else _nothing(hidden),
            extra)


@logsoftmax_stats.register_fake
def _(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
      accumulator, placeholder, extra_ids=None, compiled=False, floor=None):
    n = labels.shape[0]
    f32 = [hidden.new_empty(n, dtype=_F32) for _ in range(5)]
    x = hidden.new_empty((n, hidden.shape[1])) if sequence_parallel else _nothing(hidden)
    extra = hidden.new_empty(extra_ids.shape, dtype=_F32) if extra_ids is not None else coef.new_empty(0)
    return f32[0], f32[1], f32[2], hidden.new_empty(n, dtype=torch.bool), f32[3], f32[4], x, extra


@custom_op("mcore_hooks::logsoftmax_stats_backward", mutates_args=("accumulator",))
def logsoftmax_stats_backward(
    x: Tensor, weight: Tensor, labels: Tensor, valid: Tensor, coef: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, backend: str, m: Tensor,
    log_s: Tensor, entropy: Tensor, g_logprob: Optional[Tensor], g_entropy: Optional[Tensor], need_x: bool,
    need_w: bool, accumulator: Optional[Tensor], extra_ids: Optional[Tensor] = None,
    extra_g: Optional[Tensor] = None, extra_logits: Optional[Tensor] = None,
    floor: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``(dX, dW)`` of ``sum g_logprob * logprob + g_entropy * entropy`` (``x`` all tokens; dX
    reduced over the group, this rank's shard under sequence parallelism); empty where not
    asked for, or dW where it went into ``accumulator``. ``g_logprob`` / ``g_entropy``: the
    outputs' upstream gradients as autograd gives them (None where unused; read only where
    ``valid``: :meth:`~..common.autograd.Backend.grads`). ``extra_g``: the gradient of the
    ``extra_ids``' logits, ``extra_logits`` (the forward's) with them; ``floor``: the
    forward's."""
    local_label = labels  # local rows already (KernelParams.local_labels)
    extra = None
    if extra_ids is not None and extra_g is not None:
        if extra_logits is None:
            raise ValueError("logsoftmax_stats_backward: extra_g needs extra_logits, the forward's "
                             "logits of extra_ids")
        owned, cols = cand.owned_rows(extra_ids, vocab_start, weight.shape[0])
        extra = (torch.where(owned, cols, -1), extra_g, extra_logits)
    dx, dw = _backend(backend, x.device).grads(
        x, weight, coef, local_label, m, log_s, entropy, g_logprob, g_entropy, valid, chunk_size,
        need_x, need_w, accumulator if need_w else None, extra,
        **({} if floor is None else {"floor": floor}))
    if dx is not None:
        dx = comm.reduce_hidden_grad(dx, _group(group), sequence_parallel, invariant(backend))
    return (_nothing(x) if dx is None else dx), (_nothing(weight) if dw is None else dw)


@logsoftmax_stats_backward.register_fake
def _(x, weight, labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
      m, log_s, entropy, g_logprob, g_entropy, need_x, need_w, accumulator, extra_ids=None,
      extra_g=None, extra_logits=None, floor=None):
    rows = x.shape[0] // _fake_group_size(group) if sequence_parallel else x.shape[0]
    dx = x.new_empty((rows, x.shape[1])) if need_x else _nothing(x)
    dw = weight.new_empty(weight.shape) if need_w and accumulator is None else _nothing(weight)
    return dx, dw


def _stats_setup(ctx, inputs, output):
    (hidden, weight, labels, valid, coef, vocab_start, group, sp, chunk_size, backend, accumulator,
     placeholder) = inputs[:12]
    _, entropy, logz, _, m, log_s, gathered, extra = output
    # only the log-prob and entropy carry gradients; the rest are for the backward or detached
    # by contract (and no zeros are made for the gradients of outputs the loss did not use)
    ctx.mark_non_differentiable(logz, m, log_s, gathered)
    ctx.set_materialize_grads(False)
    extra_ids = inputs[12] if len(inputs) > 12 else None
    floor = inputs[14] if len(inputs) > 14 else None
    ctx.save_for_backward(gathered if sp else hidden, weight, labels, valid, coef, m, log_s, entropy,
                          extra_ids, extra, floor)
    ctx.inputs = len(inputs)
    ctx.args = (vocab_start, group, sp, chunk_size, backend)
    # not saved: it is written between this forward and its backward by design (other
    # micro-batches' backwards), which save_for_backward's version check would refuse
    ctx.accumulator = accumulator
    ctx.hidden_shape, ctx.placeholder = hidden.shape, placeholder


# Named where a double backward is refused (guards.first_order), and why.
_NAME = "the log-prob pass (linear_logprob_entropy)"
_WHY = "its gradients are made from the forward's statistics (max, log-sum-exp) taken as constants"


def _stats_backward(ctx, d_logprob, d_entropy, _logz, _best, _m, _log_s, _gathered, d_extra):
    x, weight, labels, valid, coef, m, log_s, entropy, extra_ids, extra, floor = ctx.saved_tensors
    accumulator = ctx.accumulator
    # as they come: the backends read an ignored token's gradient nowhere (no NaN * 0), and an
    # unused output's (None) as 0, without a launch for either (float32 already: the outputs')
    g1, g2 = d_logprob, d_entropy
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    acc = accumulator if need_w else None
    e_g = d_extra.float() if d_extra is not None and extra_ids is not None else None
    # never differentiated (the statistics are constants to it): with create_graph=True the
    # gradients are made as without, and first_order refuses their derivative
    with torch.no_grad():
        dx, dw = call(logsoftmax_stats_backward, x, weight, labels, valid, coef, *ctx.args, m, log_s,
                      entropy, g1, g2, need_x, need_w, acc, extra_ids, e_g,
                      extra if e_g is not None else None, floor)
    dx = dx.view(ctx.hidden_shape) if need_x else None
    if acc is not None:
        dw = guards.placeholder_grad_like(weight.shape, weight.dtype, weight.device) if ctx.placeholder else None
    elif not need_w:
        dw = None
    return guards.first_order(_NAME, dx, dw, anchor=entropy, why=_WHY) + (None,) * (ctx.inputs - 2)


register_autograd(logsoftmax_stats, _stats_backward, _stats_setup)


class _OneRank(torch.autograd.Function):
    """The pass on one rank (no group, no extra ids, no floor), eager: the backend's forward and
    backward under one autograd Function, the formula :func:`_stats_setup` and
    :func:`_stats_backward` give the op there, without the op's layers (its 15-argument list,
    :func:`~..common.dispatch.call`'s generic Function, the backend looked up twice, stand-ins for
    outputs it does not have). At RL's small calls the host bounds the time: 0.10-0.16 ms of a
    1.2-1.4 ms call on an H200 machine (``benchmarks/RESULTS.md``, ``profile_calls.py
    --timeline``). ``test_the_one_rank_eager_function_is_the_op`` holds the two to the same
    bits."""

    @staticmethod
    def forward(ctx, hidden, weight, p: KernelParams, impl):
        logprob, entropy, logz, best, m, log_s, valid, coef, local = _one_rank(hidden, weight, p, impl)
        ctx.mark_non_differentiable(logz, best)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, local, valid, coef, m, log_s, entropy)
        # only what the backward reads (the global labels are not); the accumulator not saved:
        # written between this forward and its backward by design (as the op's)
        ctx.accumulator, ctx.placeholder = p.weight_grad_accumulator, p.dummy_weight_grad
        ctx.args, ctx.impl = (p.vocab_start, p.chunk_size, p.backend), impl
        return logprob, entropy, logz, best

    @staticmethod
    def backward(ctx, d_logprob, d_entropy, _logz, _best):
        x, weight, labels, valid, coef, m, log_s, entropy = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = ctx.accumulator if need_w else None
        vocab_start, chunk_size, backend = ctx.args
        if tracing():  # compiled autograd traces this backward: the op, which it can trace
            dx, dw = logsoftmax_stats_backward(
                x, weight, labels, valid, coef, vocab_start, None, False, chunk_size, backend, m,
                log_s, entropy, d_logprob, d_entropy, need_x, need_w, acc)
            dx, dw = (dx if need_x else None), (dw if need_w and acc is None else None)
        else:
            with torch.no_grad():  # as the op's formula: first_order refuses a double backward
                dx, dw = ctx.impl.grads(x, weight, coef, labels, m, log_s, entropy, d_logprob,
                                        d_entropy, valid, chunk_size, need_x, need_w, acc)
        if acc is not None:
            dw = guards.placeholder_grad_like(weight.shape, weight.dtype, weight.device) \
                if ctx.placeholder else None
        return guards.first_order(_NAME, dx, dw, anchor=entropy, why=_WHY) + (None, None)


def _one_rank(hidden: Tensor, weight: Tensor, p: KernelParams, impl) -> tuple[Tensor, ...]:
    """The Triton backend's statistics on one rank, and the per-token inputs ``(valid, coef,
    local labels)``: ``p``'s, or made by the pass where ``p.prologue`` folds them into it."""
    if p.prologue is not None:
        return impl.stats_with_prologue(hidden, weight, p.labels, p.prologue)
    return impl.stats(hidden, weight, p.coef, p.local_labels, p.valid, p.chunk_size, None,
                      invariant(p.backend)) + (p.valid, p.coef, p.local_labels)


def _unfolded(p: KernelParams) -> KernelParams:
    """``p`` with the per-token inputs its ``prologue`` left to the statistics pass made by the
    prologue's own kernel (for a path that cannot fold them)."""
    from ..triton_backend import triton_fused  # lazily: it imports Triton

    coef, ignore_index, v_total, vocab_start, v_local = p.prologue
    valid, coefs, local = triton_fused.TritonFused.prologue(
        p.labels.contiguous(), None, coef, 1.0, ignore_index, v_total, vocab_start, v_local)
    return dataclasses.replace(p, valid=valid, coef=coefs, local_labels=local, prologue=None)


def stats(hidden: Tensor, weight: Tensor, p: KernelParams,
          floor: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logprob, entropy, logz, label_is_argmax)`` through the op, differentiable in ``hidden``
    and ``weight`` (the weight's gradient into ``p.weight_grad_accumulator`` where one is given);
    with ``floor``, of each token's kept set (as the op's). Eager on one rank, the Triton
    backend's: :class:`_OneRank`, the op's implementation and formula with fewer layers."""
    if (p.group is None and not p.sequence_parallel and floor is None
            and p.backend.startswith("triton") and not tracing()):
        impl = _backend(p.backend, hidden.device)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _OneRank.apply(hidden, weight, p, impl)
        return _one_rank(hidden, weight, p, impl)[:4]
    if p.prologue is not None:  # _prepare folds only where the branch above runs; made all the same
        p = _unfolded(p)
    args = (hidden, weight, p.local_labels, p.valid, p.coef, p.vocab_start, group_name(p.group),
            p.sequence_parallel, p.chunk_size, p.backend, p.weight_grad_accumulator,
            p.dummy_weight_grad, None, torch.compiler.is_compiling())
    out = call(logsoftmax_stats, *args, *(() if floor is None else (floor,)))
    return out[0], out[1], out[2], out[3]
