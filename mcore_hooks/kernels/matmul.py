"""Matrix products with float32 results from bf16/fp16 operands, so a product is never rounded to
the operands' precision: cuBLAS accumulates in fp32 and writes fp32 (``out_dtype``, CUDA); other
devices, or a torch without ``out_dtype``, multiply fp32 copies."""

from __future__ import annotations

from typing import Optional

import torch


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` as float32 (into ``out``, a float32 tensor, when given)."""
    if a.dtype != torch.float32 and a.is_cuda:
        try:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            # beta=0: out's old contents (possibly NaN) are ignored
            return torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    if out is None:
        return a.float() @ b.float()
    return torch.mm(a.float(), b.float(), out=out)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with a float32 ``acc``, in one product where cuBLAS can take fp32 C."""
    if a.dtype != torch.float32 and a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc.addmm_(a.float(), b.float())
