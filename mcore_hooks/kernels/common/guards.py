"""The guards of the fused passes' contracts with autograd and with an accumulator
(Megatron's ``main_grad``): what must hold for a gradient added in the forward (a declared
``upstream_grad``) to be added exactly once and received, and for gradients formed in the
forward never to pass for differentiable ones.

* an accumulator handed to a compiled graph is refused where a copy of it would take the
  gradient (:func:`check_accumulator_kept`); a declared forward where it may run again
  (:func:`check_not_recomputed`);
* a declared forward that fails after its first addition leaves NaN, never a partial gradient
  (:func:`adding_into`); one whose graph goes without its backward warns, and a second backward
  raises (:func:`expect_backward`, :func:`backward_ran`); the gradient received must be the
  one declared (:func:`check_upstream_grad`);
* gradients formed in the forward raise if differentiated again (:func:`first_order`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
import weakref
from typing import Optional

import torch

from .dispatch import tracing


def placeholder_grad_like(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-stride zero gradient (nothing of ``shape`` allocated): what a weight whose gradient
    went into an accumulator gets instead of none, so hooks on its gradient still run."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks are on (an activation-checkpointed region, an
    offloading scope)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def check_accumulator_kept() -> None:
    """For an op handed the accumulator (Megatron's ``main_grad``) for its backward, as part of
    a compiled graph. Recorded as a CUDA graph, its replays would add into the recording's copy
    of the accumulator: refused while recording. The graph saves the accumulator with its other
    saved tensors, so default saved-tensor hooks that hand back a copy (``save_on_cpu``,
    activation offloading) would have the backward add into the copy, the weight's gradient lost. Refused before anything runs.
    An activation checkpoint's hooks hand back the tensor itself (or its recomputation, which
    for an input of the region is the input): allowed, and exact. Eager keeps the accumulator
    out of the saved tensors, exact under any hooks."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "main_grad (gradient_accumulation_fusion) under CUDA graphs (torch.compile "
            "mode='reduce-overhead'): a replay would add the weight's gradient into the "
            "recording's own copy of main_grad; compile without CUDA graphs, or with "
            "gradient_accumulation_fusion off")
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) != "torch.utils.checkpoint":
        raise ValueError(
            "main_grad (gradient_accumulation_fusion) under torch.compile inside saved-tensor "
            "hooks (save_on_cpu, activation offloading): the compiled graph would save main_grad "
            "through the hooks and add the weight's gradient into a copy; run that call eager, "
            "without the hooks, or with gradient_accumulation_fusion off")


def check_not_recomputed() -> None:
    """``upstream_grad`` adds into the accumulator in the forward, so the forward must run exactly
    once per backward. Refuse where it may run again: inside an activation-checkpointed region
    (its saved-tensor hooks are active, and the backward re-runs the region) or in a backward
    pass (a recomputation). Without ``upstream_grad`` the gradient is added in the backward,
    which runs once, so that mode stays exact there. Checked where the op runs (under
    ``torch.compile`` too), before anything is added."""
    hooked = saved_tensor_hooks_active()
    if hooked or torch._C._current_graph_task_id() != -1:
        raise ValueError(
            "upstream_grad: the loss is computed "
            + ("under saved-tensor hooks (an activation-checkpointed region, whose forward the "
               "backward runs again, or an offloading scope, which cannot be told apart from one)"
               if hooked else "inside a backward pass (a recomputation)")
            + ", so its weight gradient would be added into the accumulator more than once; "
            "leave upstream_grad None there (the gradient is then added in the backward, once)"
        )


_ADDING: contextvars.ContextVar = contextvars.ContextVar("mcore_hooks_adding", default=None)


@contextlib.contextmanager
def adding_into(accumulator: Optional[torch.Tensor]):
    """The scope of a forward that adds into ``accumulator`` (a declared ``upstream_grad``):
    yields a dict whose ``"added"`` the forward sets before its first addition. If the scope
    ends in an exception after that, part of the gradient is in the accumulator and nothing
    can take it back exactly (a + b - b is not a in floating point): it is set to NaN, with a
    ``RuntimeWarning``, so no optimizer step takes a partial gradient; before any addition it is
    left as it was. Nested scopes (blocks within a call) share the outermost one."""
    outer = _ADDING.get()
    if accumulator is None or outer is not None:
        yield outer if outer is not None else {"added": False}
        return
    state = {"added": False}
    token = _ADDING.set(state)
    finished = False
    try:
        yield state
        finished = True
    finally:
        _ADDING.reset(token)
        if state["added"] and not finished:
            accumulator.fill_(math.nan)
            _warn_nan()


def _warn_nan() -> None:
    # every time (each is a step's gradient lost), not once per location: no registry
    warnings.warn_explicit(
        "upstream_grad: the forward failed after adding part of its weight gradient into the "
        "accumulator (Megatron's main_grad); it is now NaN, so that no step takes a partial "
        "gradient: zero it (e.g. model.zero_grad_buffer()) before running the step again",
        RuntimeWarning, __file__, _NAN_LINE, module=__name__, registry=None)


_NAN_LINE = _warn_nan.__code__.co_firstlineno


def expect_backward(ctx) -> None:
    """A forward that added a declared ``upstream_grad`` times its weight gradient into the
    accumulator: if its graph is freed without that backward (a forward-only call with grad
    enabled, an exception before the backward, a dropped micro-batch), the accumulator holds a
    gradient no loss received, and nothing can take it back: say so (a ``RuntimeWarning``, when
    the graph goes). The watch lives on the graph's node and goes with it. (Compiled graphs:
    not watched, their backward is traced.)"""
    if tracing():
        return
    ran: list = []
    ctx.backward_ran = ran
    # not at interpreter exit (graphs alive then are not a trainer's dropped steps)
    weakref.finalize(ctx, _warn_unreceived, ran).atexit = False


def backward_ran(ctx) -> None:
    """Called by a watched backward (:func:`expect_backward`): a second one (``retain_graph=True``)
    raises, before it gives anything: it would add dX again and nothing to the accumulator, half
    a gradient."""
    ran = getattr(ctx, "backward_ran", None)
    if ran is None:
        return
    if ran:
        raise RuntimeError(
            "upstream_grad: a second backward through a loss whose weight gradient went into the "
            "accumulator in its forward (retain_graph=True) would add the hidden states' gradient "
            "again and nothing to the weight's: half a gradient. Backpropagate such a loss once, "
            "or leave upstream_grad None (the weight's gradient is then added in each backward)")
    ran.append(True)


def _warn_unreceived(ran: list) -> None:
    if not ran:
        # every time (each is a step's corrupted gradient), not once per location: no registry
        warnings.warn_explicit(
            "upstream_grad: a forward added its weight gradient (times the declared upstream "
            "gradient) into the accumulator (Megatron's main_grad), and its graph was freed "
            "without that backward, so the accumulator holds a gradient that no loss received; "
            "run forward-only calls under torch.no_grad() (nothing is added there), and zero "
            "the accumulator after a step that failed between its forward and backward",
            RuntimeWarning, __file__, _WARN_LINE, module=__name__, registry=None)


_WARN_LINE = _warn_unreceived.__code__.co_firstlineno


def first_order(name: str, *grads: Optional[torch.Tensor], anchor: Optional[torch.Tensor] = None,
                why: str = "its gradients are formed in the forward") -> tuple:
    """``grads`` as a backward returns them. Where they are being built with ``create_graph=True``
    (grad mode is on in the backward) each gets a node that raises if differentiated, as
    ``once_differentiable``'s do: gradients formed in the forward from float32 values that hold
    no graph would otherwise be taken as constants, and a double backward would silently drop
    their derivative. ``anchor``: a saved output of the forward (the loss, a scalar), an input of
    that node too, so the node lies on every path from the gradients back to the forward's
    inputs: ``torch.autograd.grad(f(dX), x)`` reaches it and raises, rather than finding no
    path and answering None (zero). ``why``: what makes them constants, for the error. (Compiled
    backwards refuse a double backward themselves.)"""
    if not torch.is_grad_enabled() or tracing():
        return grads
    tensors = [g for g in grads if g is not None]
    if not tensors:
        return grads
    inputs = [g.detach().requires_grad_() for g in tensors]
    if anchor is not None and anchor.requires_grad:
        inputs.append(anchor)
    err = torch._C._functions.DelayedError(
        f"{name}: {why}, so they cannot be differentiated again "
        "(a double backward, create_graph=True, is not supported)", len(inputs))
    out = err(*inputs)
    it = iter(out if isinstance(out, tuple) else (out,))
    return tuple(None if g is None else next(it) for g in grads)


def check_upstream_grad(grad: torch.Tensor, declared: float) -> None:
    """That the gradient a loss received is the one declared when its weight gradient went into
    the accumulator in the forward. On the device, without waiting for it: a mismatch stops
    the process with a device-side assertion (at once on the CPU), never a wrong gradient."""
    what = (f"upstream_grad: the loss was declared to receive the gradient {declared!r} in its "
            "backward (its weight gradient, scaled by that, was added into the accumulator in the "
            "forward), but received ")
    same = grad.detach().float() == declared  # in float32, as the accumulator was scaled
    if grad.device.type == "cpu" and not tracing():  # readable without a wait
        if not bool(same):
            raise RuntimeError(what + f"{float(grad)!r}: declare the value your loss function and "
                               "the schedule give it (megatron_upstream_grad), or leave it None")
        return
    # on the device the value cannot be printed without a host sync (and CUDA takes < 255 chars)
    torch._assert_async(
        same, f"upstream_grad: the loss received a gradient other than the declared {declared!r}, "
        "by which its weight gradient was added into main_grad; see megatron_upstream_grad")
