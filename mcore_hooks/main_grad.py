"""Megatron's gradient-accumulation fusion: the output weight's gradient straight into its float32
``main_grad``, and the hand-off that tells Megatron DDP it is there.

Where the config asks for ``gradient_accumulation_fusion``, Megatron's own linear layers add their
weight gradient into ``main_grad`` and hand autograd a placeholder; the processors do the same
through the kernels' ``weight_grad_accumulator`` and :func:`main_grad_route`.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

__all__ = ["main_grad_accumulator", "main_grad_route"]


def main_grad_accumulator(weight: torch.Tensor, config: Any) -> Optional[torch.Tensor]:
    """Megatron's float32 ``main_grad`` of the output weight, where the weight's gradient is to go
    straight into it: the config asks for ``gradient_accumulation_fusion`` (Megatron's own linear
    layers then add their weight gradient there), the weight has a float32 ``main_grad`` and
    needs a gradient. None otherwise, and under Megatron-FSDP (whose ``main_grad`` buffers are
    made on demand): the gradient then goes to ``.grad`` and DDP adds it, as for any layer."""
    if not (getattr(config, "gradient_accumulation_fusion", False) and torch.is_grad_enabled()):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if (not weight.requires_grad or hasattr(weight, "__fsdp_param__")
            or not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32):
        return None
    return main_grad


class _MainGradHandoff(torch.autograd.Function):
    """Megatron's protocol for a weight gradient added straight into ``main_grad``, as its
    ``LinearWithGradAccumulationAndAsyncCommunication`` follows it: once the kernels' backward
    has accumulated (they feed this node, and hand it no gradient), mark
    ``grad_added_to_main_grad`` and hand autograd a placeholder, zeros where ``zero_out_wgrad``
    (a weight tied to the embedding on this stage, whose real gradient is added to the same
    ``.grad``), so DDP's hook runs and adds nothing twice. Without DDP's attribute: no
    gradient, as Megatron's layers return none.

    The placeholder is ``[V/tp, h]`` in the weight's dtype, as Megatron's layers allocate theirs:
    DDP's hook asserts a ``.grad`` under ``overlap_grad_reduce``, and autograd stores a gradient
    that does not have the weight's strides as a dense copy (a zero-stride one would be copied
    to full size anyway). One node serves every call that routes the weight before its backward
    runs (the main head and each MTP depth), so one placeholder is made per backward, not one per
    call for autograd to sum."""

    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.set_materialize_grads(False)  # the kernels hand this node nothing: run without zeros
        ctx.weight, ctx.main_grad, ctx.ran = weight, main_grad, False
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.ran = True
        weight = ctx.weight
        if not torch.compiler.is_compiling():  # compiled calls never enter the table
            with _LOCK:
                pending = _PENDING.get(id(weight))
                if pending is not None and pending.grad_fn is ctx:
                    del _PENDING[id(weight)]
        if grad is not None:  # from an op other than the kernels that used the routed weight
            ctx.main_grad.add_(grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None, None
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.shape, dtype=weight.dtype, device=weight.device), None


# id(weight) -> the weight's routed view whose hand-off has not run yet. Held strongly: a kernel
# that saves no weight (the fused losses) or a checkpointed region (whose saved tensors are
# packed) leaves nothing else holding it, and a dropped view would mean one more placeholder.
# The hand-off's backward removes its entry; one left by a graph freed without a backward is
# reused by the weight's next call (whose backward then runs it).
_PENDING: dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()


def _routed(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """``weight`` through the hand-off: the pending node of an earlier call when its backward has
    not run yet (one placeholder per backward), else a new one. Under ``torch.compile`` one node
    per call (the compiled graph cannot consult this table)."""
    if torch.compiler.is_compiling():
        return _MainGradHandoff.apply(weight, main_grad)
    with _LOCK:
        routed = _PENDING.get(id(weight))
        if (routed is not None and routed._base is weight and not routed.grad_fn.ran
                and routed.grad_fn.main_grad is main_grad):
            return routed
        routed = _MainGradHandoff.apply(weight, main_grad)
        _PENDING[id(weight)] = routed
        return routed


def main_grad_route(weight: torch.Tensor, config: Any) -> tuple[torch.Tensor, dict]:
    """``(weight, kernel keywords)``: where :func:`main_grad_accumulator` gives a buffer, the
    weight through the hand-off (whose placeholder reaches the parameter as Megatron's layers
    hand theirs over) and the keywords that make a kernel add into the buffer; else the weight
    and no keywords."""
    main_grad = main_grad_accumulator(weight, config)
    if main_grad is None:
        return weight, {}
    return _routed(weight, main_grad), dict(weight_grad_accumulator=main_grad)
