"""Elementwise error bounds for the kernels' gradients, from a first-order rounding-error analysis
(Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3-4), against a float64 reference.

A bound relative to the result's norm fails whenever the result cancels (a weight gradient summed
over tokens of both signs, a two-word vocabulary): rounding error scales with the sum of the
magnitudes of the terms, not with the result. So each gradient is bounded entry by entry by
the sum of |terms| of its product, computed in float64 from the reference.

Notation: u = unit roundoff (fp32 2^-24, bf16 2^-8, fp16 2^-11); a sum of K terms in any order or
blocking (BLAS, chunks) rounds each term through at most K additions: |error| <= K u sum|terms|.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch

U32 = 2.0**-24

# The analysis below is first order: it drops products of roundings (K u <= 1.2e-4 for fp32 and
# u <= 2^-8 for the input dtype here, so they change a bound by < 1%) and takes libm's exp/log
# within 1 ulp. It is a worst-case bound (every rounding of the same sign), yet one an entry
# made of one term nearly reaches in bf16/fp16 (dz rounded to the dtype, the result rounded
# again: up to 2u of it; 8000 random draws of the kernel test reached 0.98 of it), so C = 1
# would leave no margin; C = 2 leaves a factor 2 over it, while errors of 2% in bf16 (90 of 94
# draws), 1% in fp16, 0.1% in fp32, a 5% wrong temperature or a missing term fall outside.
C = 2.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def underflow(dtype: torch.dtype) -> float:
    """The absolute error of rounding a number below the normal range: half a subnormal step
    (fp16: 2^-25; negligible for fp32 and bf16)."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


class LogitGradReference(NamedTuple):
    """float64, from the inputs as given (bf16/fp16 values are exact in float64)."""

    coef: torch.Tensor  # [N] logit_scale / temperature
    logp: torch.Tensor  # [N, V]
    entropy: torch.Tensor  # [N] (every row, ignored ones included)
    g_logprob: torch.Tensor  # [N] d loss / d logprob_i (0 where ignored)
    g_entropy: torch.Tensor  # [N] d loss / d entropy_i (0 where ignored)
    labels: torch.Tensor  # [N], -100 where ignored
    dz: torch.Tensor  # [N, V] d loss / d (x W^T): the logit gradient, coef included
    loss: torch.Tensor  # scalar
    dx: torch.Tensor  # [N, H] = dz W
    dw: torch.Tensor  # [V, H] = dz^T x


def logit_grad_reference(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
    terms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    temperature: Union[float, torch.Tensor] = 1.0, scale: float = 1.0, ignore_index: int = -100,
    keep: Optional[torch.Tensor] = None,
) -> LogitGradReference:
    """float64 loss ``sum_i terms(logprob, entropy)_i`` over valid tokens (ignored ones have
    no term and no gradient), its logit gradient and dX, dW. With ``keep`` (``[N, V]`` bool,
    each row's kept set) the distribution is renormalised over it: the other logits are -inf
    (log p = -inf, p = 0: no term anywhere below)."""
    x64, w64 = x.detach().double(), w.detach().double()
    n = x.shape[0]
    t = temperature.double() if torch.is_tensor(temperature) else torch.full((n,), float(temperature), dtype=torch.float64)
    coef = scale / t
    z = (x64 @ w64.t()).requires_grad_()
    l = z * coef.unsqueeze(1)
    if keep is not None:
        l = torch.where(keep, l, -math.inf)
    logp = torch.log_softmax(l, dim=-1)
    valid = labels != ignore_index
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    finite = torch.where(torch.isfinite(logp), logp, 0.0)
    ent_all = -(finite.exp() * finite).sum(-1) if keep is None else -(logp.exp() * finite).sum(-1)
    ent = torch.where(valid, ent_all, 0.0)
    lp_leaf, ent_leaf = lp.detach().requires_grad_(), ent.detach().requires_grad_()
    loss = torch.where(valid, terms(lp_leaf, ent_leaf), 0.0).sum()
    g1, g2 = torch.autograd.grad(loss, [lp_leaf, ent_leaf], allow_unused=True)
    g1 = torch.zeros_like(lp) if g1 is None else torch.where(valid, g1, 0.0)
    g2 = torch.zeros_like(lp) if g2 is None else torch.where(valid, g2, 0.0)
    (lp * g1 + ent * g2).sum().backward()
    dz = z.grad
    return LogitGradReference(coef, logp.detach(), ent_all.detach(), g1, g2, labels, dz,
                              loss.detach(), dz @ w64, dz.t() @ x64)


def _finite(logp: torch.Tensor) -> torch.Tensor:
    """log p with the -inf outside a kept set as 0 (multiplied by p = 0 wherever it is used)."""
    return torch.where(torch.isfinite(logp), logp, 0.0)


def logprob_error(ref: LogitGradReference, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[N, 1]: a bound on the absolute error of each fp32 log p_ij (also the relative error of
    p_ij = exp(log p_ij), less 2u for the exp), as the kernels form it:
    l = coef * (x W^T) in fp32 (a dot of H terms, then the coef product and coef's own rounding:
    dl_ij <= (H + 2) u coef_i sum_h |x_ih w_jh|; Lam_i = max_j dl_ij);
    log p = (l - m) - log s with m = max_j l (an l: error <= Lam), s = sum_j exp(l_j - m) (each
    term relative Lam + Lam + u|l_j - m| + 2u, summed over V terms: V u; the p-weighted
    sum_j p_j |l_j - m| <= H + log V), log s adds u |log s| + u:
    |d log p_ij| <= 3 Lam_i + u (V + 2 D_i + 4 log V + H_i + 6), with D_i the logit range
    (|l_ij - m| and |log p_ij| <= D_i + log V)."""
    hidden, vocab = x.shape[1], w.shape[0]
    a = x.detach().double().abs() @ w.detach().double().abs().t()
    lam = ((hidden + 2) * U32 * ref.coef.unsqueeze(1) * a).amax(1, keepdim=True)
    logp = _finite(ref.logp)
    lo = torch.where(torch.isfinite(ref.logp), ref.logp, math.inf).amin(1)
    d = (logp.amax(1) - lo).unsqueeze(1)
    log_v = math.log(vocab)
    return 3 * lam + U32 * (vocab + 2 * d + 4 * log_v + ref.entropy.unsqueeze(1) + 6)


def logit_grad_error(
    ref: LogitGradReference, x: torch.Tensor, w: torch.Tensor,
    g_rel: Union[float, torch.Tensor] = 0.0,
) -> torch.Tensor:
    """[N, V]: a bound on |fp32 logit gradient - ref.dz|, entry by entry, as the kernels form it:
    dl_j = g1 1[j = y] - p_j (g1 + g2 (log p_j + H)), dz = coef dl.
    With eps the log-prob error (:func:`logprob_error`) and the entropy's
    dH <= 2 eps (1 + D + log V) (H = log s - sum_j p_j (l_j - m): each term's error
    (1 + |l_j - m|) eps, p-weighted), and M_j = |g1| + |g2| (|log p_j| + H):
    |d dl_j| <= p_j ((eps + 6u) M_j + |g2| (eps + dH))    p's relative error, the products' u's
              + 2u |g1| 1[j = y]                        the add at the label: ulps of 1 - p_y,
                                                        which no relative bound covers when the
                                                        prediction is near certain
              + g_rel (|g1| (1[j = y] + p_j) + |g2| p_j (|log p_j| + H))   g1, g2's own error
              + t (2 M_j + 3)                           fp32 underflow (t = 2^-150, half a
                                                        subnormal step): p_j = exp(log p_j)
                                                        below 2^-126 within 1 subnormal ulp, and
                                                        the subnormal products after it
    then coef's product and rounding: |d dz| <= coef (|d dl| + 2u |dl|) + t.
    ``g_rel``: the relative error of the derivatives g1, g2 as the loss forms them in fp32 (per
    token, [N] or a float)."""
    vocab = w.shape[0]
    eps = logprob_error(ref, x, w)
    p, logp = ref.logp.exp(), _finite(ref.logp)  # outside a kept set: p = 0, no term
    lo = torch.where(torch.isfinite(ref.logp), ref.logp, math.inf).amin(1)
    d = (logp.amax(1) - lo).unsqueeze(1)
    h = ref.entropy.unsqueeze(1)
    d_h = 2 * eps * (1 + d + math.log(vocab))
    g1, g2 = ref.g_logprob.abs().unsqueeze(1), ref.g_entropy.abs().unsqueeze(1)
    g_rel = torch.as_tensor(g_rel, dtype=torch.float64)
    g_rel = g_rel.unsqueeze(1) if g_rel.dim() == 1 else g_rel
    at_label = torch.zeros_like(p)
    at_label.scatter_(1, ref.labels.clamp(min=0).unsqueeze(1), 1.0)
    at_label *= (ref.labels != -100).unsqueeze(1)
    m = g1 + g2 * (logp.abs() + h)
    e_dl = (p * ((eps + 6 * U32) * m + g2 * (eps + d_h)) + 2 * U32 * g1 * at_label
            + g_rel * (g1 * (at_label + p) + g2 * p * (logp.abs() + h))
            + underflow(torch.float32) * (2 * m + 3))
    coef = ref.coef.unsqueeze(1)
    return coef * e_dl + 2 * U32 * ref.dz.abs() + underflow(torch.float32)


class GradBounds(NamedTuple):
    dx: torch.Tensor  # [N, H]
    dw: torch.Tensor  # [V, H]


def grad_bounds(
    ref: LogitGradReference, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
    g_rel: Union[float, torch.Tensor] = 0.0, dw_depth: Optional[int] = None,
) -> GradBounds:
    """Elementwise bounds on |dX - ref.dx| and |dW - ref.dw| for gradients the kernels form as
    dz (fp32, error e_dz: :func:`logit_grad_error`) rounded to ``dtype`` (u_in |dz| + the
    underflow floor ``tiny``), products accumulated in fp32 (t: fp32's underflow floor), results
    rounded to ``dtype``:
      |d dX| <= C ((e_dz + u_in |dz| + tiny) |W| + V (u32 |dz| |W| + t) + u_out |dX| + tiny)
      |d dW| <= C ((e_dz + u_in |dz| + tiny)^T |x| + K (u32 |dz|^T |x| + t) + u_out |dW| + tiny)
    (x and W are exact in their dtype: the inputs are not rounded again), K = ``dw_depth``, the
    additions a term of dW passes through (default N: any blocking of N terms, chunked or not,
    plus the product's rounding)."""
    x64, w64 = x.detach().double().abs(), w.detach().double().abs()
    u_io, tiny = unit_roundoff(dtype), underflow(dtype)
    adz = ref.dz.abs()
    e_in = logit_grad_error(ref, x, w, g_rel) + u_io * adz + tiny
    k_w = x.shape[0] if dw_depth is None else dw_depth
    t32 = underflow(torch.float32)  # each fp32 product or sum that lands below the normal range
    bdx = e_in @ w64 + w.shape[0] * (U32 * (adz @ w64) + t32) + u_io * ref.dx.abs() + tiny
    bdw = e_in.t() @ x64 + k_w * (U32 * (adz.t() @ x64) + t32) + u_io * ref.dw.abs() + tiny
    return GradBounds(C * bdx, C * bdw)


def ratio(ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """max |ours - ref| / bound: <= 1 passes."""
    return ((ours.double() - ref).abs() / bound).max().item()


def accumulator_bound(
    ref: LogitGradReference, x: torch.Tensor, w: torch.Tensor, start: torch.Tensor,
    g_rel: Union[float, torch.Tensor] = 0.0,
) -> torch.Tensor:
    """A bound on |acc - (start + ref.dw)| for an fp32 accumulator that each token chunk's
    ``dz_c^T x_c`` (scaled by the upstream gradient, folded into ``ref``) is added into, one
    ``addmm_`` a chunk. ``start`` is one more term of that sum of N + 1: a BLAS may add the
    chunk's products into C one at a time (this machine's does: 10 u |start| seen over 5 chunks),
    so ``start`` goes through up to N roundings, each term of dW through up to N additions, its
    product's and the upstream factor's rounding:
      |d acc| <= C (N u |start| + (e_dz + u |dz|)^T |x| + (N + 2) u |dz|^T |x| + u |dW|)."""
    n = x.shape[0]
    dw = grad_bounds(ref, x, w, torch.float32, g_rel, dw_depth=n + 2).dw
    return dw + C * n * U32 * start.double().abs()
