"""fp32-result products: the out_dtype overloads are found in torch's registry, and an error from
a product (out-of-memory above all) reaches the caller instead of a silent fp32-copy retry."""

from __future__ import annotations

import pytest
import torch

from mcore_hooks.kernels.common import matmul

pytestmark = pytest.mark.release_independent


def test_overload_detection_reads_the_registry():
    assert matmul._cuda_overload("aten::no_such_operator.dtype") is False
    # CPU tensors never take the CUDA overloads, whatever this torch has
    a = torch.randn(3, 4, dtype=torch.bfloat16)
    assert matmul._fp32_product(a, "aten::mm.dtype") is False
    out = matmul.mm_f32(a, a.t())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a.float() @ a.float().t())


def test_out_of_memory_is_never_swallowed(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    # Pretend the fp32-result overloads exist and fail the way a full device fails.
    monkeypatch.setattr(matmul, "_fp32_product", lambda a, op: True)
    monkeypatch.setattr(torch, "mm", out_of_memory)
    monkeypatch.setattr(torch, "addmm", out_of_memory)
    a = torch.randn(2, 2, dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        matmul.mm_f32(a, a)
    with pytest.raises(torch.OutOfMemoryError):
        matmul.mm_f32(a, a, out=torch.empty(2, 2))
    with pytest.raises(torch.OutOfMemoryError):
        matmul.addmm_f32_(torch.zeros(2, 2), a, a)
