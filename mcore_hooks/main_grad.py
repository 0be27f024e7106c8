"""Megatron's gradient-accumulation fusion: the output weight's gradient straight into its float32
``main_grad``, and the hand-off that tells Megatron DDP it is there.

Where the config asks for ``gradient_accumulation_fusion``, Megatron's own linear layers add their
weight gradient into ``main_grad`` and hand autograd a placeholder; the processors do the same
through the kernels' ``weight_grad_accumulator`` and :func:`main_grad_route`.

Nothing here outlives the autograd graph that needs it: the hand-off is a node of that graph
(freed with it, whether or not a backward runs), and the only sharing between calls is inside
one :func:`shared_routes` block (one model forward with its MTP depths). Eager, its backward's
side effects (the flag DDP reads, the placeholder) run in a custom op. A compiled backward is
traced once and replays no Python side effect: there the weight is not marked, and DDP gets a
gradient it adds itself (zeros, or another op's). CUDA graphs are refused (the kernels'
``guards.check_accumulator_kept``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

__all__ = ["main_grad_accumulator", "main_grad_route", "shared_routes"]


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


# An op (``torch.compile`` keeps it whole): it writes ``main_grad`` (declared: a compiled graph
# orders it after the kernels' own additions and never drops it) and, eager, sets the flag DDP
# reads (a compiled backward with DDP's flags does not call it: see _MainGradHandoff.backward).
@torch.library.custom_op("mcore_hooks::main_grad_handoff", mutates_args=("main_grad",),
                         tags=(torch.Tag.cudagraph_unsafe,))
def main_grad_handoff(weight: Tensor, main_grad: Tensor, grad: Optional[Tensor], mark: bool,
                      zero: bool) -> Tensor:
    """The hand-off's backward, at run time: ``grad`` (from an op other than the kernels, which
    add into ``main_grad`` themselves) added into ``main_grad``; with ``mark`` (the weight has
    DDP's ``grad_added_to_main_grad``), the weight marked and Megatron's placeholder returned,
    ``[V/tp, h]`` in the weight's dtype, zeros where ``zero`` (``zero_out_wgrad``: a weight tied
    to the embedding on this stage, whose real gradient DDP adds from the same ``.grad``).
    Without ``mark``: empty."""
    if grad is not None:
        main_grad.add_(grad)
    if not mark:
        return weight.new_empty(0)
    if not hasattr(weight, "grad_added_to_main_grad"):
        raise RuntimeError(_LOST)
    weight.grad_added_to_main_grad = True
    make = torch.zeros if zero else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


_LOST = ("main_grad hand-off: the output weight reached the backward without Megatron DDP's "
         "grad_added_to_main_grad it had in the forward, so its gradient cannot be handed to DDP; "
         "was the weight replaced between the forward and the backward?")


@main_grad_handoff.register_fake
def _(weight, main_grad, grad, mark, zero):
    return weight.new_empty(weight.shape if mark else (0,))


class _MainGradHandoff(torch.autograd.Function):
    """Megatron's protocol for a weight gradient added straight into ``main_grad``, as its
    ``LinearWithGradAccumulationAndAsyncCommunication`` follows it: a node between the weight
    and the kernels that use it, whose backward runs once they have all accumulated (they feed
    it no gradient) and hands the weight the placeholder (:func:`main_grad_handoff`), so DDP's
    hook runs and adds nothing twice. Without DDP's attribute: no gradient, as Megatron's layers
    return none. ``mark`` and ``zero`` are read in the forward, from the real weight (a traced
    backward would see a fake one without them)."""

    @staticmethod
    def forward(ctx, weight, main_grad, mark: bool, zero: bool):
        ctx.set_materialize_grads(False)  # the kernels hand this node nothing: run without zeros
        # the parameter itself and its buffer, not saved: saved-tensor hooks (an activation-
        # checkpointed region, offloading) would hand the backward detached copies (the weight
        # without DDP's attributes), and the buffer is written between forward and backward
        ctx.weight, ctx.main_grad, ctx.mark, ctx.zero = weight, main_grad, mark, zero
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if ctx.mark and torch.compiler.is_compiling():
            # Compiled (and CUDA-graphed) backwards replay no Python side effect, so the weight
            # cannot be marked: DDP is handed the gradient itself, zeros (AOTAutograd
            # materialises the kernels' none) or another op's, and adds it into main_grad as
            # for any unmarked weight. The kernels' own share is in main_grad already.
            return (grad if grad is not None else torch.zeros_like(ctx.weight)), None, None, None
        placeholder = main_grad_handoff(ctx.weight, ctx.main_grad, grad, ctx.mark, ctx.zero)
        return (placeholder if ctx.mark else None), None, None, None


# Within one shared_routes() block, id(weight) -> its routed view: the main head and
# each MTP depth of one forward share one hand-off node, so autograd gets one placeholder per
# forward, not one per call to sum. The table is the block's own and goes with it.
_ROUTES: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("mcore_hooks_routes", default=None)


@contextlib.contextmanager
def shared_routes() -> Iterator[None]:
    """Within the block (one model forward, or one schedule-plan post-process node, with its MTP
    depths) every call that routes a weight shares one hand-off node; none outside it."""
    token = _ROUTES.set({})
    try:
        yield
    finally:
        _ROUTES.reset(token)


def _routed(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    mark = hasattr(weight, "grad_added_to_main_grad")
    zero = bool(getattr(weight, "zero_out_wgrad", False))
    if torch.compiler.is_compiling():
        # compiled with DDP's flags the backward hands DDP a gradient and needs no main_grad:
        # left out of the node, so the graph sees it only where the kernels add into it
        return _MainGradHandoff.apply(weight, None if mark else main_grad, mark, zero)
    routes = _ROUTES.get()
    if routes is None:
        return _MainGradHandoff.apply(weight, main_grad, mark, zero)
    routed = routes.get(id(weight))  # the block holds the weight: its id is not reused there
    if routed is None:
        routed = routes[id(weight)] = _MainGradHandoff.apply(weight, main_grad, mark, zero)
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
