"""The fused losses as custom ops (see :mod:`.ops`): a loss with its gradients formed in the
forward (``fused_token_loss``; ``fused_token_loss_into_`` with its upstream gradient declared;
``accumulate_weight_grad_``, its weight gradient into Megatron's ``main_grad`` in the backward),
per-token terms after the statistics pass (``token_terms``), and a loss given as a Python
function (:class:`LinearFusedLoss`, not an op)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..common import autograd as ag
from ..common import guards
from ..common import comm
from ..common.debug import check_values
from ..common.dispatch import call, custom_op, register_autograd, tracing
from ..common.losses import PolicyLoss, WeightedNLL, per_token_loss
from ..common.matmul import addmm_f32_
from .ops import _F32, _backend, _nothing, _params, group_name, invariant, reduce_hidden_grad
from ..common.options import KernelParams

# PolicyLoss as op data: its fields in this order, None as NaN, kl_type as 1.0 for "k3"
_POLICY_FIELDS = ("clip_low", "clip_high", "dual_clip", "kl_coef", "kl_type", "entropy_coef",
                  "log_ratio_limit")


def policy_loss_data(loss: PolicyLoss) -> list[float]:
    """:class:`PolicyLoss` as a list of floats (an op argument)."""
    out = []
    for f in _POLICY_FIELDS:
        v = getattr(loss, f)
        out.append(float(v == "k3") if f == "kl_type" else math.nan if v is None else float(v))
    return out


def _policy_loss(data: list[float]) -> PolicyLoss:
    kw = {f: (None if math.isnan(v) else v) for f, v in zip(_POLICY_FIELDS, data)}
    kw["kl_type"] = "k3" if data[_POLICY_FIELDS.index("kl_type")] == 1.0 else "k1"
    return PolicyLoss(**kw)


def _token_loss(token_weight: Tensor, policy: Optional[list[float]], inputs: list[Tensor],
                valid: Tensor) -> ag.TokenLoss:
    if policy is None:
        return WeightedNLL(token_weight)
    loss = _policy_loss(policy)
    return per_token_loss(loss).bind(token_weight, dict(zip(loss.input_names, inputs)), valid)


def forms_gradients_in_forward(backend: str, hidden_size: int) -> bool:
    """Whether a fused loss on this backend forms its gradients in the forward (6NHV, float32
    dX and dW held until the backward) rather than in the backward from the statistics pass
    (8NHV, the logits recomputed there): the forward, at every hidden size by default
    (``TritonFused.forward_gradients_min_hidden``). Decided by the hidden size alone, never the
    call's size, so a token's results do not follow the call (batch invariance)."""
    base = backend.partition("+")[0]
    if base == "torch":
        return True
    from ..triton_backend import triton_fused  # lazily: it imports Triton, slow and optional

    return hidden_size >= triton_fused.TritonFused.forward_gradients_min_hidden


@custom_op("mcore_hooks::token_terms", mutates_args=())
def token_terms(
    logprob: Tensor, entropy: Tensor, valid: Tensor, token_weight: Tensor,
    policy: Optional[list[float]], inputs: list[Tensor], backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(terms, d terms / d logprob, d terms / d entropy)``, float32 ``[N]``, 0 where not
    ``valid``: the weighted NLL (``policy`` None) or a :class:`PolicyLoss` (its fields,
    :func:`policy_loss_data`; its ``input_names`` tensors in ``inputs``) of per-token log-probs
    and entropies, its derivatives formed here (the terms are differentiable through them)."""
    if backend.partition("+")[0] == "triton":
        from ..triton_backend import triton_fused

        if any(check_values(t) for t in inputs):  # debug checks on: PerTokenLoss.bind's refusals
            _token_loss(token_weight, policy, inputs, valid)
        loss = None if policy is None else _policy_loss(policy)
        return triton_fused.TritonFused.token_terms(logprob, entropy, valid, token_weight, loss, inputs)
    loss = _token_loss(token_weight, policy, inputs, valid)
    terms, d_lp, d_ent = ag.term_grads(loss, slice(0, logprob.shape[0]), logprob,
                                       entropy if loss.needs_entropy else None)
    zero = torch.zeros_like(logprob)
    return (torch.where(valid, terms, 0.0), torch.where(valid, d_lp, 0.0),
            zero if d_ent is None else torch.where(valid, d_ent, 0.0))


@token_terms.register_fake
def _(logprob, entropy, valid, token_weight, policy, inputs, backend):
    return logprob.new_empty(logprob.shape), logprob.new_empty(logprob.shape), logprob.new_empty(logprob.shape)


def _terms_setup(ctx, inputs, output):
    _, d_lp, d_ent = output
    ctx.mark_non_differentiable(d_lp, d_ent)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(d_lp, d_ent)
    ctx.num_inputs = len(inputs[5])


def _terms_backward(ctx, d_terms, _d_lp, _d_ent):
    d_lp, d_ent = ctx.saved_tensors
    if d_terms is None:
        return (None,) * 5 + ([None] * ctx.num_inputs, None)
    return (d_terms * d_lp, d_terms * d_ent) + (None,) * 3 + ([None] * ctx.num_inputs, None)


register_autograd(token_terms, _terms_backward, _terms_setup)


def _defers_weight_grad(backend: str, n: int, weight: Tensor, chunk_size: int,
                        sequence_parallel: bool, need_w: bool, into: bool) -> bool:
    """Whether a fused loss keeps its logit gradient for the backward to form dW from, rather
    than forming dW in float32 in the forward (few tokens on the Triton backend: see
    ``TritonFused.saved_dz_tokens`` and ``saved_dz_bytes``; one chunk; dW returned, not added
    into an accumulator; the backward then needs the hidden states, which sequence parallelism
    would have to gather again: not there). From shapes alone, so the fake implementation
    agrees."""
    if not need_w or into or sequence_parallel or backend.partition("+")[0] != "triton" or n > chunk_size:
        return False
    from ..triton_backend import triton_fused

    fused = triton_fused.TritonFused
    return n <= fused.saved_dz_tokens and n * weight.shape[0] * weight.element_size() <= fused.saved_dz_bytes


def _fused_impl(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel,
                chunk_size, backend, accumulator, upstream_grad, token_weight, policy, inputs,
                need_x, need_w):
    p = _params(labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
                accumulator, upstream_grad)
    x = comm.gather_tokens(hidden, p.group) if sequence_parallel else hidden
    return _fused_outputs(x, weight, p, _backend(backend, hidden.device),
                          _token_loss(token_weight, policy, inputs, valid), need_x, need_w)


def _fused_outputs(x, weight, p: KernelParams, impl, token_loss: ag.TokenLoss, need_x: bool,
                   need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`fused_token_loss`'s outputs from the backend ``impl`` (``x`` all tokens; ``p``'s
    local labels the rows; ``p.upstream_grad`` declared only with its accumulator)."""
    defer = _defers_weight_grad(p.backend, x.shape[0], weight, p.chunk_size, p.sequence_parallel,
                                need_w, p.upstream_grad is not None)
    r = impl.fused_loss(x, weight, p, p.local_labels, token_loss, need_x, need_w,
                        defer_weight_grad=defer)
    entropy = r.entropy if r.entropy is not None else torch.zeros_like(r.logprob)
    dw = r.dz if defer else r.dw
    return (r.loss.sum(), r.logprob, entropy, _nothing(x) if r.dx is None else r.dx,
            _nothing(weight) if dw is None else dw)


_FUSED_NAME = "linear_cross_entropy / linear_policy_loss"


def _fused_fake(hidden, weight, labels, need_x, need_w, into: bool, chunk_size: int = 0,
                backend: str = "", sequence_parallel: bool = False):
    n = labels.shape[0]
    dx = hidden.new_empty((n, hidden.shape[1]), dtype=_F32) if need_x else _nothing(hidden)
    if _defers_weight_grad(backend, n, weight, chunk_size, sequence_parallel, need_w, into):
        dw = weight.new_empty((n, weight.shape[0]))  # the logit gradient, for the backward
    else:
        dw = weight.new_empty(weight.shape, dtype=_F32) if need_w and not into else _nothing(weight)
    return (hidden.new_empty((), dtype=_F32), hidden.new_empty(n, dtype=_F32),
            hidden.new_empty(n, dtype=_F32), dx, dw)


@custom_op("mcore_hooks::fused_token_loss", mutates_args=())
def fused_token_loss(
    hidden: Tensor, weight: Tensor, labels: Tensor, valid: Tensor, coef: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, backend: str,
    token_weight: Tensor, policy: Optional[list[float]], inputs: list[Tensor], need_x: bool,
    need_w: bool, accumulator: Optional[Tensor], placeholder: bool, compiled: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, logprob, entropy, dX, dW)``: the summed loss (float32 scalar), detached per-token
    log-probs and entropies (zeros where the loss does not use them), and the float32 gradients
    of the loss, all tokens' dX and this rank's dW (empty where not needed; for few tokens, see
    :func:`_defers_weight_grad`, the logit gradient ``[N, V_local]`` in the input dtype
    instead, which the backward forms dW from). The loss is the weighted NLL (``policy``
    None) or a :class:`PolicyLoss` (its fields, :func:`policy_loss_data`) with its
    ``input_names`` tensors in ``inputs``; ``labels``: this rank's local rows
    (``KernelParams.local_labels``). ``accumulator`` (Megatron's ``main_grad``, with
    ``placeholder`` and ``compiled`` as :func:`logsoftmax_stats`'s) is for the backward alone,
    which adds the upstream gradient times dW into it."""
    if accumulator is not None and compiled:
        guards.check_accumulator_kept()
    return _fused_impl(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel,
                       chunk_size, backend, None, None, token_weight, policy, inputs, need_x, need_w)


@fused_token_loss.register_fake
def _(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
      token_weight, policy, inputs, need_x, need_w, accumulator, placeholder, compiled):
    return _fused_fake(hidden, weight, labels, need_x, need_w, False, chunk_size, backend,
                       sequence_parallel)


def _fused_setup(ctx, inputs, output):
    hidden, _, _, _, _, _, group, sp, _, backend = inputs[:10]
    _, logprob, entropy, dx32, dw32 = output
    # the loss alone takes a gradient: the per-token values are detached by contract, the
    # float32 gradients are for the backward (no zeros made for their gradients). dX's stays
    # attached in eager calls, first_order's anchor: an output nobody else sees, where the loss
    # may be divided in place before its backward (Megatron's schedule does); traced, where
    # first_order adds nothing, it is detached too (no tangent made for it)
    ctx.mark_non_differentiable(logprob, entropy, dw32, *((dx32,) if inputs[-1] else ()))
    ctx.set_materialize_grads(False)
    _keep_for_backward(ctx, hidden, inputs[1].shape, dx32, dw32, inputs[15], inputs[16], group, sp,
                       invariant(backend))
    ctx.num_inputs = len(inputs[12])


def _keep_for_backward(ctx, hidden, weight_shape, dx32, dw32, accumulator, placeholder, group, sp,
                       ordered) -> None:
    """What :func:`_fused_grads` reads: the float32 dX (first_order's anchor), dW or the kept
    logit gradient (with the hidden states it is formed with), where dW goes, and shapes."""
    deferred = dw32.numel() and dw32.dtype != _F32  # the logit gradient: dW formed from it
    ctx.save_for_backward(dx32, dw32, hidden if deferred else None)
    # not saved: written between this forward and its backward by design (see _stats_setup)
    ctx.accumulator, ctx.placeholder = accumulator, placeholder
    ctx.weight_shape = weight_shape
    ctx.group, ctx.sp, ctx.ordered = group, sp, ordered
    ctx.hidden_shape, ctx.dtype = hidden.shape, hidden.dtype


def _scaled(t32: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """``t32 * grad`` (``t32`` float32, or the input dtype: a kept logit gradient; ``grad`` a
    float32 scalar) in float32, rounded to ``dtype`` once: one Triton pass where it runs, eager
    (torch's mul of mixed dtypes runs at a fraction of the memory's speed, 0.14 ms for a 256 x
    151936 bf16 logit gradient on an H200); else torch, through a float32 copy of a 16-bit
    ``t32``."""
    if t32.is_cuda and t32.is_contiguous() and not tracing() and dtype != _F32:
        from ..triton_backend import triton_fused, triton_tiles

        if triton_tiles.device_tiles(t32.device) is not None:
            return triton_fused.TritonFused.scale_cast(t32, grad, dtype)
    # in float32, as the kernel: a 16-bit t with a float32 scalar would multiply in t's dtype,
    # the scalar rounded to it first
    return torch.mul(t32.float(), grad, out=torch.empty(t32.shape, dtype=dtype, device=t32.device))


def _hidden_grad(ctx, dx32: Tensor, grad: Tensor) -> Optional[Tensor]:
    if not (ctx.needs_input_grad[0] and dx32.numel()):
        return None
    return reduce_hidden_grad(_scaled(dx32, grad, ctx.dtype), ctx.group, ctx.sp,
                              ctx.ordered).view(ctx.hidden_shape)


def _scaled_logit_grad(dz: Tensor, grad: Tensor) -> Tensor:
    """The kept logit gradient times the upstream gradient, rounded to its dtype once: as stock's
    backward rounds its float32 logit gradient, the upstream gradient in it, to the logits'
    dtype before its weight-gradient product. A power-of-two gradient (1, 1 / num_microbatches)
    adds no rounding in bf16 (in fp16 a small one may reach its subnormals, a large one
    overflow, as stock's fp16 logit gradient would); another rounds each element once more,
    2**-8 relative in bf16, the size of stock's own rounding. A new tensor (N x V in dz's
    dtype, for the backward's product): a retained graph's second backward reads the kept one
    again."""
    return _scaled(dz, grad, dz.dtype)


def _weight_grad(dz: Tensor, x: Tensor, grad: Tensor) -> Tensor:
    """``dW = (grad * dz).T @ x`` in x's dtype from the kept logit gradient ``dz [N, V]``:
    cuBLAS's product (float32 sums, one rounding), as stock forms dW. (A Triton kernel applying
    ``grad`` to the float32 sum took 0.96 ms where stock's cuBLAS dW took 0.52 at 256 x 4096 x
    151936, 2.99 against 1.87 at 512 x 8192, H200: its tiles' short sums end in long epilogues
    that cuBLAS's persistent kernels overlap.)"""
    return torch.mm(_scaled_logit_grad(dz, grad).t(), x)


@custom_op("mcore_hooks::accumulate_weight_grad_", mutates_args=("accumulator",))
def accumulate_weight_grad_(accumulator: Tensor, dw: Tensor, x: Optional[Tensor], grad: Tensor) -> None:
    """``accumulator += grad * dW`` in float32: ``dw`` the float32 dW formed in the forward, or
    (``x`` given) the logit gradient ``[N, V_local]``, and ``(grad * dw).T @ x`` added in one
    product (see :func:`_weight_grad`), as Megatron's wgrad GEMM adds into ``main_grad``."""
    if x is not None:
        addmm_f32_(accumulator, _scaled_logit_grad(dw, grad).t(), x)
        return
    eager = not tracing() and accumulator.is_cuda and accumulator.is_contiguous()
    if eager:
        from ..triton_backend import triton_fused, triton_tiles

        eager = triton_tiles.device_tiles(accumulator.device) is not None
    if eager and dw.is_contiguous():
        triton_fused.TritonFused.scale_accumulate(dw, grad, accumulator)
    else:
        accumulator.addcmul_(dw, grad.float())


@accumulate_weight_grad_.register_fake
def _(accumulator, dw, x, grad):
    return None


def _fused_backward(ctx, grad, *_):
    # one entry per input, a list for the list of tensors
    return _fused_grads(ctx, grad) + (None,) * 10 + ([None] * ctx.num_inputs, None, None, None, None, None)


def _fused_grads(ctx, grad: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dX, dW)`` of a fused loss whose forward kept what :func:`_keep_for_backward` says: its
    float32 gradients times the loss's gradient ``grad``, dW added into the accumulator where
    there is one."""
    anchor, dw32, x = ctx.saved_tensors
    dx32 = anchor.detach()  # attached to this node where saved (see _fused_setup)
    if grad is None:
        grad = torch.zeros((), dtype=_F32, device=dx32.device)
    dw = None
    if ctx.needs_input_grad[1] and dw32.numel() and ctx.accumulator is not None:
        call(accumulate_weight_grad_, ctx.accumulator, dw32, x, grad)
        if ctx.placeholder:
            dw = guards.placeholder_grad_like(ctx.weight_shape, ctx.dtype, dw32.device)
    elif ctx.needs_input_grad[1] and dw32.numel():
        dw = _scaled(dw32, grad, ctx.dtype) if x is None else _weight_grad(dw32, x, grad)
    return guards.first_order(_FUSED_NAME, _hidden_grad(ctx, dx32, grad), dw, anchor=anchor)


register_autograd(fused_token_loss, _fused_backward, _fused_setup)


class _OneRankLoss(torch.autograd.Function):
    """:func:`fused_token_loss` on one rank (no group), eager, on the Triton backend: its
    implementation and formula (:func:`_fused_outputs`, :func:`_fused_setup`'s
    :func:`_keep_for_backward`, :func:`_fused_grads`) without the op's layers: the generic
    Function over its 18 arguments, and the parameters rebuilt from them. (The loss is bound
    as the op binds it, through its fields as data: the same object, the same bits.) At RL's
    small calls the host bounds the time, as the log-prob pass's (:class:`~.stats_op._OneRank`).
    ``test_the_one_rank_fused_loss_function_is_the_op`` holds the two to the same bits."""

    @staticmethod
    def forward(ctx, hidden, weight, p: KernelParams, impl, token_loss: ag.TokenLoss, need_x: bool,
                need_w: bool):
        loss, logprob, entropy, dx32, dw32 = _fused_outputs(hidden, weight, p, impl, token_loss,
                                                            need_x, need_w)
        # as _fused_setup's, eager: dX's float32 rows stay attached, first_order's anchor
        ctx.mark_non_differentiable(logprob, entropy, dw32)
        ctx.set_materialize_grads(False)
        _keep_for_backward(ctx, hidden, weight.shape, dx32, dw32, p.weight_grad_accumulator,
                           p.dummy_weight_grad, None, False, p.batch_invariant)
        return loss, logprob, entropy, dx32, dw32

    @staticmethod
    def backward(ctx, grad, *_):
        return _fused_grads(ctx, grad) + (None,) * 5


@custom_op("mcore_hooks::fused_token_loss_into_", mutates_args=("accumulator",))
def fused_token_loss_into_(
    hidden: Tensor, weight: Tensor, labels: Tensor, valid: Tensor, coef: Tensor, vocab_start: int,
    group: Optional[str], sequence_parallel: bool, chunk_size: int, backend: str,
    accumulator: Tensor, upstream_grad: float, token_weight: Tensor, policy: Optional[list[float]],
    inputs: list[Tensor], need_x: bool, need_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`fused_token_loss` with the loss's gradient declared (``upstream_grad``):
    ``upstream_grad * dW`` is added into ``accumulator`` here (dW comes back empty)."""
    return _fused_impl(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel,
                       chunk_size, backend, accumulator, upstream_grad, token_weight, policy, inputs,
                       need_x, need_w)


@fused_token_loss_into_.register_fake
def _(hidden, weight, labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
      accumulator, upstream_grad, token_weight, policy, inputs, need_x, need_w):
    return _fused_fake(hidden, weight, labels, need_x, need_w, into=True)


class _FusedIntoAccumulator(torch.autograd.Function):
    """The differentiable side of :func:`fused_token_loss_into_` (an op that writes into an
    input cannot have a registered autograd formula): the backward scales dX and checks that
    the loss got the declared gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, args: tuple, placeholder: bool):
        loss, logprob, entropy, dx32, _ = call(fused_token_loss_into_, hidden, weight, *args)
        if args[-1]:  # need_w: the weight's gradient went into the accumulator
            guards.expect_backward(ctx)
        # dX's float32 rows: an output too (the caller drops it), first_order's anchor, where
        # the loss may be divided in place before its backward
        ctx.save_for_backward(dx32)
        ctx.group, ctx.sp, ctx.upstream_grad, ctx.placeholder = args[4], args[5], args[9], placeholder
        ctx.ordered = invariant(args[7])
        ctx.hidden_shape, ctx.dtype = hidden.shape, hidden.dtype
        ctx.weight_shape = weight.shape
        ctx.mark_non_differentiable(logprob, entropy)
        ctx.set_materialize_grads(False)
        return loss, logprob, entropy, dx32

    @staticmethod
    def backward(ctx, grad, *_):
        guards.backward_ran(ctx)
        anchor, = ctx.saved_tensors
        dx32 = anchor.detach()
        if grad is None:  # not materialised (see forward): the loss itself took none
            grad = torch.zeros((), dtype=_F32, device=dx32.device)
        dw = None
        if ctx.needs_input_grad[1]:
            guards.check_upstream_grad(grad, ctx.upstream_grad)
            if ctx.placeholder:
                dw = guards.placeholder_grad_like(ctx.weight_shape, ctx.dtype, grad.device)
        return guards.first_order(_FUSED_NAME, _hidden_grad(ctx, dx32, grad), dw, anchor=anchor) + (None, None)


def _eager_one_rank(p: KernelParams) -> bool:
    """Whether :class:`_OneRankLoss` takes the call: one rank, the Triton backend, eager."""
    return p.group is None and not p.sequence_parallel and p.backend.startswith("triton") and not tracing()


def fused_loss(hidden: Tensor, weight: Tensor, p: KernelParams, token_weight: Tensor,
               policy: Optional[PolicyLoss], inputs: list[Tensor], need_x: bool,
               need_w: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, logprob, entropy)`` of the weighted NLL (``policy`` None) or a
    :class:`PolicyLoss`, gradients formed in the forward, through the ops (eager on one rank, the
    Triton backend's: :class:`_OneRankLoss`, the op's implementation and formula with fewer
    layers)."""
    data = None if policy is None else policy_loss_data(policy)
    declared = p.upstream_grad is not None and p.weight_grad_accumulator is not None
    if not declared and _eager_one_rank(p):
        impl = _backend(p.backend, hidden.device)
        return _OneRankLoss.apply(hidden, weight, p, impl, _token_loss(token_weight, data, inputs, p.valid),
                                  need_x, need_w)[:3]
    args = (p.local_labels, p.valid, p.coef, p.vocab_start, group_name(p.group), p.sequence_parallel,
            p.chunk_size, p.backend)
    if declared:
        return _FusedIntoAccumulator.apply(
            hidden, weight, args + (p.weight_grad_accumulator, p.upstream_grad, token_weight, data,
                                    inputs, need_x, need_w), p.dummy_weight_grad)[:3]
    out = call(fused_token_loss, hidden, weight, *args, token_weight, data, inputs, need_x, need_w,
               p.weight_grad_accumulator, p.dummy_weight_grad, torch.compiler.is_compiling())
    return out[0], out[1], out[2]


class LinearFusedLoss(torch.autograd.Function):
    """A :class:`~..common.autograd.TokenLoss` that is not data (a Python function, bound to its inputs)
    summed over tokens, with its gradients formed in the forward (``Backend.fused_loss``), as
    the ``fused_token_loss`` ops do; not an op, so ``torch.compile`` breaks the graph here. dX and
    dW stay float32 until the backward scales them by the upstream gradient (one rounding each,
    as the stock single matmul's). With a declared upstream gradient dW is already in the
    accumulator, scaled by it, and the backward checks that the gradient it gets is that one."""

    @staticmethod
    def forward(ctx, hidden, weight, p: KernelParams, token_loss: ag.TokenLoss, need_x: bool,
                need_w: bool):
        x = comm.gather_tokens(hidden, p.group) if p.sequence_parallel else hidden
        local_label = p.local_labels
        r = _backend(p.backend, hidden.device).fused_loss(x, weight, p, local_label, token_loss,
                                                          need_x, need_w)
        if need_w and p.upstream_grad is not None and p.weight_grad_accumulator is not None:
            guards.expect_backward(ctx)
        total = r.loss.sum()
        # first_order's anchor: an output the caller drops (the loss may be divided in place
        # before its backward, as Megatron's schedule does); empty, so nothing is kept for it
        anchor = total.new_empty(0)
        ctx.save_for_backward(r.dx, r.dw, anchor)
        ctx.params, ctx.hidden_shape, ctx.dtype = p, hidden.shape, x.dtype
        ctx.weight_shape = weight.shape
        entropy = r.entropy if r.entropy is not None else torch.zeros_like(r.logprob)
        ctx.mark_non_differentiable(r.logprob, entropy)
        ctx.set_materialize_grads(False)
        return total, r.logprob, entropy, anchor

    @staticmethod
    def backward(ctx, grad, _d_logprob, _d_entropy, _d_anchor):
        guards.backward_ran(ctx)
        dx32, dw32, anchor = ctx.saved_tensors
        if grad is None:  # not materialised (see forward): the loss itself took none
            grad = torch.zeros((), dtype=torch.float32, device=anchor.device)
        p: KernelParams = ctx.params
        dx = dw = None
        if dx32 is not None:
            dx = comm.reduce_hidden_grad(_scaled(dx32, grad, ctx.dtype), p.group, p.sequence_parallel,
                                       p.batch_invariant)
            dx = dx.view(ctx.hidden_shape)
        if dw32 is not None:
            dw = _scaled(dw32, grad, ctx.dtype)
        elif p.upstream_grad is not None and ctx.needs_input_grad[1]:
            guards.check_upstream_grad(grad, p.upstream_grad)
            if p.dummy_weight_grad:
                dw = guards.placeholder_grad_like(ctx.weight_shape, ctx.dtype, grad.device)
        return guards.first_order(_FUSED_NAME, dx, dw, anchor=anchor) + (None, None, None, None)
