"""Triton backend: the two passes of :mod:`.autograd` with the logits fused into the matmul.

Forward (``local_stats``): one kernel, grid (token blocks x vocab splits). Each program computes a
``[BLOCK_N, BLOCK_V]`` logits tile with ``tl.dot`` over the hidden size (fp32 accumulators), scales
it by ``coef = logit_scale / temperature`` and folds it into running per-row max / sum-exp /
entropy term / label logit held in registers; logits never reach memory. The per-split partials
(``[splits, N]``, a few MiB) are merged in PyTorch. Any vocabulary size: tiles past the end are
masked, no divisibility is assumed.

Backward (``grads``): the vocabulary is walked in chunks of ``Vc`` rows. A kernel recomputes the
``[N, Vc]`` logits tile by tile and writes their gradient ``dz`` (in the input dtype) once; cuBLAS
then forms ``dW[chunk] = dz.T @ X`` in one call (a single rounding, K = N) and accumulates
``dX += dz @ W[chunk]`` into a float32 buffer. No atomics: results are deterministic.

bf16/fp16 inputs only (fp32 inputs use the torch backend, whose fp32 matmuls are exact).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

from .autograd import LocalStats, merge_partials

try:  # Triton is optional; the torch backend needs none of this.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
try:  # host-side tensor descriptors (TMA on Hopper), Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def available(device: torch.device) -> bool:
    """Whether this backend can run on ``device`` (CUDA, or the Triton interpreter for tests)."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda"


# Tile shapes (fastest of those profiled on an H200): wide vocab tiles amortise the softmax
# epilogue; 8 warps drive Hopper's wgmma.
_FWD = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3)
_BWD = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, num_warps=8, num_stages=3)
# Backward gradient chunk [N, Vc] in the input dtype: about this many bytes. Measured on an H200
# at 16384 x 4096 x 151936 (benchmarks/profile_kernels.py): Vc = 4096 lets cuBLAS accumulate dX
# at 91% of the matmul ceiling, against 80% at 2048.
_BWD_CHUNK_BYTES = 128 << 20
# Fewest vocab splits of the forward grid: 4 measured fastest with TMA loads (32.9 ms, against
# 35.1 at 8; benchmarks/profile_h200_tma.log).
_MIN_SPLITS = 4
# Load tiles through tensor descriptors (Hopper's bulk copy engine) instead of pointer loads:
# forward 32.9 ms vs 37.1, logit-gradient kernel 33.3 ms vs 38.8 at 16384 x 4096 x 151936.
_USE_TMA = True


if triton is not None:

    @triton.jit
    def _logits_tile(X, W, rows, cols, rmask, cmask, row0, col0, H, stride_x, stride_w,
                     BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_TMA: tl.constexpr):
        """fp32 ``X[rows] @ W[cols].T``; X/W are tensor descriptors (TMA) or plain pointers."""
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        if USE_TMA:  # the copy engine zero-fills out-of-bounds rows, columns and K tails
            for k in range(0, tl.cdiv(H, BLOCK_K)):
                x = X.load([row0, k * BLOCK_K])
                w = W.load([col0, k * BLOCK_K])
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            x_ptr = X + rows[:, None].to(tl.int64) * stride_x + offs_k[None, :]
            w_ptr = W + cols[:, None].to(tl.int64) * stride_w + offs_k[None, :]
            for k in range(0, tl.cdiv(H, BLOCK_K)):
                if EVEN_K:
                    x = tl.load(x_ptr, mask=rmask[:, None], other=0.0)
                    w = tl.load(w_ptr, mask=cmask[:, None], other=0.0)
                else:
                    kmask = offs_k[None, :] < H - k * BLOCK_K
                    x = tl.load(x_ptr, mask=rmask[:, None] & kmask, other=0.0)
                    w = tl.load(w_ptr, mask=cmask[:, None] & kmask, other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
                x_ptr += BLOCK_K
                w_ptr += BLOCK_K
        return acc

    @triton.jit
    def _stats_fwd_kernel(
        X, W, COEF, LABEL, M, S, A, T,
        N, V, H, stride_x, stride_w, tiles_per_split, splits,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        # Split index fastest: the programs running together share a few row blocks (their X
        # stays in L2) and walk neighbouring vocab ranges, instead of 100+ row blocks
        # re-reading X from memory for every vocab tile.
        pid = tl.program_id(0)
        pid_n = pid // splits
        pid_s = pid % splits
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        coef = tl.load(COEF + rows, mask=rmask, other=1.0)
        label = tl.load(LABEL + rows, mask=rmask, other=-1)
        # Finite start: (m_old - m_new) * s stays 0, never -inf * 0, before the first tile.
        m = tl.full([BLOCK_N], -1e30, dtype=tl.float32)
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        a = tl.zeros([BLOCK_N], dtype=tl.float32)
        t = tl.zeros([BLOCK_N], dtype=tl.float32)
        for vt in range(0, tiles_per_split):
            col0 = (pid_s * tiles_per_split + vt) * BLOCK_V
            cols = col0 + tl.arange(0, BLOCK_V)
            cmask = cols < V
            l = _logits_tile(X, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, col0, H,
                             stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                             USE_TMA) * coef[:, None]
            l = tl.where(cmask[None, :], l, -float("inf"))
            t += tl.sum(tl.where(cols[None, :] == label[:, None], l, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(l, axis=1))
            alpha = tl.exp(m - m_new)
            d = tl.where(cmask[None, :], l - m_new[:, None], 0.0)  # masked: 0, not -inf
            e = tl.where(cmask[None, :], tl.exp(d), 0.0)
            a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            m = m_new
        out = pid_s * N + rows
        tl.store(M + out, m, mask=rmask)
        tl.store(S + out, s, mask=rmask)
        tl.store(A + out, a, mask=rmask)
        tl.store(T + out, t, mask=rmask)

    @triton.jit
    def _dlogits_kernel(
        X, W, COEF, LABEL, LOGZ, ENT, G1, G2, DZ,
        N, V, H, v0, Vc, stride_x, stride_w, stride_dz,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        pid_v = tl.program_id(0)  # vocab tile fastest: the chunk's W stays in L2, X blocks too
        pid_n = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols_local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v0 + cols_local
        cmask = (cols_local < Vc) & (cols < V)
        coef = tl.load(COEF + rows, mask=rmask, other=1.0)
        logz = tl.load(LOGZ + rows, mask=rmask, other=0.0)
        ent = tl.load(ENT + rows, mask=rmask, other=0.0)
        g1 = tl.load(G1 + rows, mask=rmask, other=0.0)
        g2 = tl.load(G2 + rows, mask=rmask, other=0.0)
        label = tl.load(LABEL + rows, mask=rmask, other=-1)
        # Under TMA a tile may run past the chunk into the next one's rows; those columns are
        # computed and then masked (cmask), never stored.
        logp = _logits_tile(X, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, v0 + pid_v * BLOCK_V,
                            H, stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                            USE_TMA) * coef[:, None] - logz[:, None]
        p = tl.exp(logp)
        # d/dl_j of g1*logprob + g2*entropy; then through l = coef * z
        dl = -p * (g1[:, None] + g2[:, None] * (logp + ent[:, None]))
        dl += tl.where(cols[None, :] == label[:, None], g1[:, None], 0.0)
        dz = dl * coef[:, None]
        ptr = DZ + rows[:, None].to(tl.int64) * stride_dz + cols_local[None, :]
        tl.store(ptr, dz.to(DZ.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(index).multi_processor_count


def _operands(x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> tuple[Any, Any, bool]:
    """Tensor descriptors for the copy engine where it can be used, else the tensors themselves."""
    # The copy engine needs 16-byte aligned base addresses and row strides.
    use = (
        _USE_TMA
        and TensorDescriptor is not None
        and (x.shape[1] * x.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )
    if not use:
        return x, weight, False
    return (
        TensorDescriptor.from_tensor(x, [cfg["BLOCK_N"], cfg["BLOCK_K"]]),
        TensorDescriptor.from_tensor(weight, [cfg["BLOCK_V"], cfg["BLOCK_K"]]),
        True,
    )


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with fp32 ``acc`` and bf16/fp16 ``a``, ``b`` (fp32 accumulation)."""
    if acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
        try:
            acc += torch.mm(a, b, out_dtype=torch.float32)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc += a.float() @ b.float()


class TritonFused:
    name = "triton"

    @staticmethod
    def local_stats(x, weight, coef, local_label, chunk_size) -> LocalStats:
        n, h = x.shape
        v = weight.shape[0]
        cfg = _FWD
        row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
        vtiles = triton.cdiv(v, cfg["BLOCK_V"])
        # Each split walks a contiguous vocab range. At least _MIN_SPLITS of them, so programs
        # running together share row blocks; more when there are few row blocks, to fill the SMs.
        want = max(_MIN_SPLITS, math.ceil(2 * _num_sms(x.device.index or 0) / row_blocks))
        tiles_per_split = triton.cdiv(vtiles, min(vtiles, want))
        splits = triton.cdiv(vtiles, tiles_per_split)
        x, weight = x.contiguous(), weight.contiguous()
        parts = torch.empty((4, splits, n), dtype=torch.float32, device=x.device)
        xa, wa, tma = _operands(x, weight, cfg)
        _stats_fwd_kernel[(row_blocks * splits,)](
            xa, wa, coef.contiguous(), local_label.contiguous(),
            parts[0], parts[1], parts[2], parts[3],
            n, v, h, x.stride(0), weight.stride(0), tiles_per_split, splits,
            EVEN_K=h % cfg["BLOCK_K"] == 0, USE_TMA=tma, **cfg,
        )
        return merge_partials(LocalStats(*parts))

    @staticmethod
    def grads(x, weight, coef, local_label, logz, entropy, g1, g2, chunk_size, need_x, need_w):
        n, h = x.shape
        v = weight.shape[0]
        cfg = _BWD
        x, weight = x.contiguous(), weight.contiguous()
        vc = max(cfg["BLOCK_V"], (_BWD_CHUNK_BYTES // (max(n, 1) * x.element_size())) // cfg["BLOCK_V"] * cfg["BLOCK_V"])
        vc = min(vc, triton.cdiv(v, cfg["BLOCK_V"]) * cfg["BLOCK_V"])
        dz = torch.empty((n, vc), dtype=x.dtype, device=x.device)
        dx = torch.zeros((n, h), dtype=torch.float32, device=x.device) if need_x else None
        dw = torch.empty_like(weight) if need_w else None
        row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
        xa, wa, tma = _operands(x, weight, cfg)
        for v0 in range(0, v, vc):
            width = min(vc, v - v0)
            _dlogits_kernel[(triton.cdiv(width, cfg["BLOCK_V"]), row_blocks)](
                xa, wa, coef, local_label, logz, entropy, g1, g2, dz,
                n, v, h, v0, width, x.stride(0), weight.stride(0), dz.stride(0),
                EVEN_K=h % cfg["BLOCK_K"] == 0, USE_TMA=tma, **cfg,
            )
            chunk = dz[:, :width]
            if need_w:
                torch.mm(chunk.t(), x, out=dw[v0 : v0 + width])
            if need_x:
                _accumulate_mm(dx, chunk, weight[v0 : v0 + width])
        return (dx.to(x.dtype) if need_x else None), dw
