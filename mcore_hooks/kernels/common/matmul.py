"""Matrix products with float32 results from bf16/fp16 operands, so a product is never rounded to
the operands' precision: cuBLAS accumulates in fp32 and writes fp32 (torch's ``out_dtype``
overloads, CUDA); other devices, or a torch without those overloads, multiply fp32 copies.

Whether the overloads exist is read once from torch's operator registry, never found out by
trying a product and catching its error (which would also catch out-of-memory).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _cuda_overload(op: str) -> bool:
    """Whether this torch registers a CUDA kernel for the operator overload ``op``."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is None:
        return False
    try:
        return bool(has_kernel(op, "CUDA"))
    except RuntimeError:  # a registry lookup: raised only when the overload does not exist
        return False


def _fp32_product(a: torch.Tensor, op: str) -> bool:
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _cuda_overload(op)


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` as float32 (into ``out``, a float32 tensor, when given)."""
    if out is None:
        if _fp32_product(a, "aten::mm.dtype"):
            return torch.mm(a, b, out_dtype=torch.float32)
        return a.float() @ b.float()
    if _fp32_product(a, "aten::addmm.dtype_out"):
        # beta=0: out's old contents (possibly NaN) are ignored
        return torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """``acc += alpha * (a @ b)`` with a float32 ``acc``, in one product where cuBLAS can take
    fp32 C."""
    if _fp32_product(a, "aten::addmm.dtype_out"):
        torch.addmm(acc, a, b, alpha=alpha, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float(), alpha=alpha)


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` as float32 (an fp32 ``a`` with a bf16/fp16 ``b`` multiplies fp32 copies)."""
    if a.dtype == b.dtype and _fp32_product(a, "aten::bmm.dtype"):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())
