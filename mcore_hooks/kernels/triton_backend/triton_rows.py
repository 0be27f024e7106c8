"""Triton backend: the fused losses' per-row and per-token launches (their kernels in
:mod:`.triton_losses`, the prologue's in :mod:`.triton_kernels`), the scaling of their
gradients by the upstream gradient, and the rule for keeping a logit gradient for the backward.
:class:`TritonRows` is the part of :class:`~.triton_fused.TritonFused` that works on rows of
materialised logits, per-token values and whole gradients; the passes
over the vocabulary (statistics, the backward's chunks, dX) stay in :mod:`.triton_fused`."""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..common.autograd import LocalStats, combine, rows_of
from ..common.losses import LossData
from .triton_tiles import cdiv

try:  # Triton is optional; the torch backend needs none of this.
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# A fused loss over few tokens keeps its logit gradient dz [N, V] (input dtype) up to this many
# bytes for the backward, which forms dW from it (cuBLAS's product of the dz scaled by the
# upstream gradient: loss_op._weight_grad), instead of forming dW in float32 in the forward and
# scaling it in the backward (V x H x 4 bytes written, read, and V x H x 2 written: 2.5 ms of a
# 4 ms call at 256 x 4096 x 151936 on an H100); and up to TritonFused.saved_dz_tokens tokens.
_SAVED_DZ_BYTES = 512 << 20
# Tokens per program of the entry points' prologue.
_PROLOGUE_BLOCK = 1024
# Elements per program of the scaling of float32 gradients by the upstream gradient.
_SCALE_BLOCK = 4096
# Tokens per program of the per-token loss terms.
_TERMS_BLOCK = 1024
# Elements per step of the cross-entropy row passes (8 warps, 16 fp32 per thread).
_ROW_BLOCK = 4096

if triton is not None:  # the kernels live apart: launches here, arithmetic there
    from . import triton_losses as _tl
    from .launch import FastLaunch
    from .triton_kernels import _prologue_kernel

    # launched with less of the host's work a launch (launch.py)
    _prologue_kernel = FastLaunch(_prologue_kernel)
    _row_grad_kernel = FastLaunch(_tl._row_grad_kernel)
    _row_loss_kernel = FastLaunch(_tl._row_loss_kernel)
    _row_stats_kernel = FastLaunch(_tl._row_stats_kernel)
    _scale_accumulate_kernel = FastLaunch(_tl._scale_accumulate_kernel)
    _scale_cast_kernel = FastLaunch(_tl._scale_cast_kernel)
    _token_terms_kernel = FastLaunch(_tl._token_terms_kernel)


def _policy_constants(loss) -> tuple[float, ...]:
    """:class:`~..common.losses.PolicyLoss`'s numbers as the row-loss kernel takes them (float32 there,
    as torch rounds a Python scalar against a float32 tensor): the ratio's clamp bounds, the
    dual clip, KL and entropy coefficients and the log-ratio limit."""
    if loss is None:
        return (0.0,) * 6
    high = loss.clip_low if loss.clip_high is None else loss.clip_high
    return (1 - loss.clip_low, 1 + high, float(loss.dual_clip or 0.0), float(loss.kl_coef),
            float(loss.entropy_coef), float(loss.log_ratio_limit))


class TritonRows:
    """The fused losses' launches of :class:`~.triton_fused.TritonFused` (a mixin before
    :class:`~..common.autograd.Backend`, whose torch forms ``row_loss`` falls back to)."""

    def row_loss(self, z, p, rows, local_label, token_loss, dz, loss, logprob, entropy) -> None:
        data = getattr(token_loss, "kernel_data", None)
        if not isinstance(data, LossData):  # a Python function's terms: autograd's derivatives
            return super().row_loss(z, p, rows, local_label, token_loss, dz, loss, logprob, entropy)
        c, v = z.shape
        coef, valid = rows_of(p.coef, rows), rows_of(p.valid, rows)
        with_entropy = entropy is not None
        if p.group is None:  # the statistics from the row itself, in the same launch
            st = (coef,) * 4
        else:
            st = combine(self.row_stats(z, coef, local_label, with_entropy), p.group, p.batch_invariant)
        pol = data.policy
        kl = 0 if pol is None or pol.kl_coef == 0 else 1 if pol.kl_type == "k1" else 2
        ins = [rows_of(t, rows) for t in data.inputs] + [coef] * (3 - len(data.inputs))
        _row_loss_kernel[(c,)](
            z, z if dz is None else dz, coef, local_label, valid, *st, rows_of(data.token_weight, rows), *ins,
            loss, logprob, logprob if entropy is None else entropy, v, z.stride(0),
            0 if dz is None else dz.stride(0), *_policy_constants(pol),
            BLOCK=_ROW_BLOCK, LOCAL=p.group is None, POLICY=pol is not None,
            DUAL=pol is not None and pol.dual_clip is not None, KL=kl, ENTROPY=with_entropy,
            # Triton's CPU interpreter (the CPU tests) has no libdevice: tl.exp / tl.log there
            GRAD=dz is not None, PRECISE=os.environ.get("TRITON_INTERPRET") != "1", num_warps=8)
        return None

    saved_dz_bytes = _SAVED_DZ_BYTES
    # ... and only up to this many tokens. Both routes form dW with cuBLAS; the kept one scales
    # dz (4 N V bytes of traffic) and holds it (2 N V) where the forward route writes, reads and
    # scales a float32 dW (about 8 V H more) and holds it (4 V H). benchmarks/profile_calls.py
    # --dw-routes on an H200, kept against forward route: 0.69 / 1.60 ms at 256 x 4096 x 151936,
    # 4.15 / 6.02 at 1024 x 8192 x 151936, 0.92 / 1.00 at 2048 x 4096 x 32000, 1.90 / 1.76 at
    # 4096 x 4096 x 32000: the kept route leads to about 2048 tokens. 1024: the largest size
    # measured with the whole call on the kept side (benchmarks/RESULTS.md).
    saved_dz_tokens = 1024

    @staticmethod
    def prologue(labels: torch.Tensor, temperature: Optional[torch.Tensor], coef: float,
                 logit_scale: float, ignore_index: int, v_total: int, vocab_start: int,
                 v_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(valid, coef, local labels)`` of integer ``labels`` [N] on this GPU, one launch
        (see the kernel): ``coef`` the scalar ``logit_scale / temperature`` unless a float32
        per-token ``temperature`` is given."""
        n = labels.shape[0]
        valid = torch.empty(n, dtype=torch.bool, device=labels.device)
        out = torch.empty(n, dtype=torch.float32, device=labels.device)
        local = torch.empty(n, dtype=torch.long, device=labels.device)
        if n:
            per_token = temperature is not None
            _prologue_kernel[(cdiv(n, _PROLOGUE_BLOCK),)](
                labels, temperature if per_token else out, valid, out, local, n, ignore_index,
                v_total, vocab_start, v_local, logit_scale, coef, BLOCK=_PROLOGUE_BLOCK,
                PER_TOKEN=per_token, num_warps=4)
        return valid, out, local

    @staticmethod
    def scale_accumulate(t32: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor) -> None:
        """``accumulator += t32 * grad`` (float32 both, contiguous), in one pass."""
        n = t32.numel()
        if n:
            _scale_accumulate_kernel[(cdiv(n, _SCALE_BLOCK),)](
                t32, grad.float().reshape(1), accumulator, n, BLOCK=_SCALE_BLOCK, num_warps=8)

    @staticmethod
    def scale_cast(t32: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t32 * grad`` (``t32`` float32 or 16-bit, ``grad`` a float32 scalar tensor) in
        float32, rounded once to ``dtype``, in one pass."""
        out = torch.empty(t32.shape, dtype=dtype, device=t32.device)
        n = t32.numel()
        if n:
            _scale_cast_kernel[(cdiv(n, _SCALE_BLOCK),)](
                t32, grad.float().reshape(1), out, n, BLOCK=_SCALE_BLOCK, num_warps=8)
        return out

    @staticmethod
    def token_terms(logprob, entropy, valid, token_weight, loss, inputs):
        """:func:`~..passes.loss_op.token_terms` in one launch: the terms and their derivatives, float32."""
        n = logprob.shape[0]
        out = [torch.empty(n, dtype=torch.float32, device=logprob.device) for _ in range(3)]
        if n == 0:
            return tuple(out)
        kl = 0 if loss is None or loss.kl_coef == 0 else 1 if loss.kl_type == "k1" else 2
        ins = list(inputs) + [logprob] * (3 - len(inputs))
        _token_terms_kernel[(cdiv(n, _TERMS_BLOCK),)](
            logprob, entropy, valid, token_weight, *ins, out[0], out[1], out[2], n,
            *_policy_constants(loss), BLOCK=_TERMS_BLOCK, POLICY=loss is not None,
            DUAL=loss is not None and loss.dual_clip is not None, KL=kl,
            ENTROPY=loss is not None and loss.needs_entropy,
            PRECISE=os.environ.get("TRITON_INTERPRET") != "1", num_warps=4)
        return tuple(out)

    @staticmethod
    def row_stats(z, coef, local_label, with_entropy) -> LocalStats:
        c, v = z.shape
        m, s, a, t = torch.empty((4, c), dtype=torch.float32, device=z.device)
        _row_stats_kernel[(c,)](z, coef, local_label, m, s, a, t, v, z.stride(0),
                                BLOCK=_ROW_BLOCK, ENTROPY=with_entropy, num_warps=8)
        return LocalStats(m, s, a, t)

    @staticmethod
    def row_grad(z, coef, local_label, m, log_s, g1, g2, entropy, out):
        c, v = z.shape
        ent = g2 is not None
        _row_grad_kernel[(c,)](z, out, coef, local_label, m, log_s, g1, g2 if ent else g1,
                               entropy if ent else g1, v, z.stride(0), out.stride(0),
                               BLOCK=_ROW_BLOCK, ENTROPY=ent, num_warps=8)
        return out
