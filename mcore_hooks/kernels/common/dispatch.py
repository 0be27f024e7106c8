"""How the passes' custom ops are reached: through the dispatcher when traced, directly when eager.

The passes are ``torch.library`` custom ops (namespace ``mcore_hooks``) with fake
implementations and registered autograd, so ``torch.compile(fullgraph=True)`` keeps them whole.
Called eagerly through the dispatcher, each op costs the host about 0.4-0.8 ms (torch 2.11,
H100 machine: its schema's defaults, the pytree of its arguments, a generated autograd Function,
the aliasing check of its outputs), more than the GPU work of a whole call at RL's small micro-
batches. So :func:`call` runs an op's own Python implementation in eager code, under an autograd
Function that applies the op's registered autograd formula (its ``setup_context`` and
``backward``, the same functions): one implementation, one formula, the op for traced code.
The log-prob pass on one rank goes a step further: its own Function over the backend
(:class:`~..passes.stats_op._OneRank`), the same formula without this generic one's layers.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

# op -> its Python implementation; op -> (setup_context, backward)
_IMPL: dict[Any, Callable] = {}
_AUTOGRAD: dict[Any, tuple[Callable, Callable]] = {}


def custom_op(name: str, *, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Any]:
    """``torch.library.custom_op``, keeping the implementation for :func:`call`."""
    def wrap(fn: Callable) -> Any:
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _IMPL[op] = fn
        return op

    return wrap


def register_autograd(op: Any, backward: Callable, setup_context: Callable) -> None:
    """``op.register_autograd``, keeping the formula for :func:`call`."""
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[op] = (setup_context, backward)


class _Eager(torch.autograd.Function):
    """An op's implementation under its registered autograd formula. The op comes last among
    the arguments, so ``ctx.needs_input_grad`` indexes the op's own inputs as the formula
    expects."""

    @staticmethod
    def forward(ctx, *args):
        op, args = args[-1], args[:-1]
        out = _IMPL[op](*args)
        _AUTOGRAD[op][0](ctx, args, out)
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, *grads):
        g = _AUTOGRAD[ctx.op][1](ctx, *grads)
        # a list input (of tensors) takes one None here, where the op's formula gives a list
        return tuple(None if isinstance(x, list) else x for x in g) + (None,)


def tracing() -> bool:
    """Whether this code is being traced, not run: by Dynamo, or under a dispatch mode (the fake
    and functional tensors of AOTAutograd tracing an op's autograd formula, where
    ``torch.compiler.is_compiling()`` is False; or a user's mode, which should see the ops).
    Eager shortcuts (an op's implementation, a Triton launch) are for real tensors alone."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def call(op: Any, *args: Any) -> Any:
    """``op(*args)`` (positional arguments): the op itself where traced (:func:`tracing`), else
    its implementation (under its autograd formula where a tensor argument needs a gradient)."""
    if tracing():
        return op(*args)
    if op in _AUTOGRAD and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _Eager.apply(*args, op)
    return _IMPL[op](*args)
