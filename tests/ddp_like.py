"""Megatron DDP's view of one parameter, for tests of the ``main_grad`` route without DDP."""

from __future__ import annotations

import torch


def ddp_like(weight: torch.Tensor, zero_out_wgrad: bool = False):
    """Give ``weight`` a float32 ``main_grad``, Megatron's flags, and DDP's hook after the
    gradient's accumulation (add ``.grad`` into ``main_grad`` unless already added there, or
    always under ``zero_out_wgrad``; then drop ``.grad``). Returns the hook's handle."""
    weight.main_grad = torch.zeros(weight.shape)
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = zero_out_wgrad

    def hook(param):
        if param.grad is not None and (not param.grad_added_to_main_grad or param.zero_out_wgrad):
            param.main_grad.add_(param.grad)
        param.grad = None

    return weight.register_post_accumulate_grad_hook(hook)
