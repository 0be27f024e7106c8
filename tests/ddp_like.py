"""Megatron DDP's view of one parameter, for tests of the ``main_grad`` route without DDP (which
needs CUDA): the attributes it sets and its backward hook, registered and behaving as
``DistributedDataParallel._make_backward_post_hook``'s (Megatron Core 0.13-0.19)."""

from __future__ import annotations

import torch


class DDPHook:
    """The hook's handle: ``calls`` counts its runs (DDP's bucket counts one per parameter per
    backward); ``remove()`` takes the hook off (the attributes stay, to be read)."""

    def __init__(self, weight: torch.Tensor, overlap_grad_reduce: bool) -> None:
        self.calls = 0
        self.weight = weight
        # as DDP registers it: on the parameter's gradient accumulator, after accumulation
        self._grad_acc = weight.expand_as(weight).grad_fn.next_functions[0][0]
        self._handle = self._grad_acc.register_hook(self._hook)
        self.overlap_grad_reduce = overlap_grad_reduce

    def _hook(self, *unused) -> None:
        param = self.weight
        if self.overlap_grad_reduce:
            assert param.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad.data)
        param.grad = None
        self.calls += 1

    def zero_grad_buffer(self) -> None:
        """As DDP's ``zero_grad_buffer``: the buffer zeroed, the flag reset."""
        self.weight.main_grad.zero_()
        self.weight.grad_added_to_main_grad = False
        self.calls = 0

    def remove(self) -> None:
        self._handle.remove()


def ddp_like(weight: torch.Tensor, zero_out_wgrad: bool = False, overlap_grad_reduce: bool = True) -> DDPHook:
    """Give ``weight`` a float32 ``main_grad``, Megatron's flags (``grad_added_to_main_grad =
    False`` as DDP sets it at init) and DDP's hook after the gradient's accumulation (under
    ``overlap_grad_reduce`` it asserts a ``.grad``; it adds ``.grad`` into ``main_grad`` unless
    already added there, or always under ``zero_out_wgrad``; then drops ``.grad``)."""
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = zero_out_wgrad
    return DDPHook(weight, overlap_grad_reduce)
