"""The fused losses' kernels on the Triton backend (:mod:`.triton_fused` launches them): the chunk's
float32 logits (``_logits_kernel``), the row pass below, the row passes of a loss given as a
Python function (``_row_stats_kernel``, ``_row_grad_kernel``), the per-token terms after the
statistics pass, and the float32 gradients' scaling by the upstream gradient.

The row pass (``_row_loss_kernel``): one program a token, over its float32 logits
(``z = x @ W.T``, ``coef`` applied on load), in one launch a chunk. It forms the token's
statistics (or reads them, combined over the tensor-parallel group), its log-prob and entropy,
its loss term and the term's derivatives in them, and writes the logit gradient ``dz``: what the
generic path does with a statistics kernel, a dozen torch operations and an autograd call per
chunk (``autograd.term_grads``), which took about 0.25 ms of host time a chunk.

The loss is data (:class:`~..common.losses.LossData`): the weighted NLL, or :class:`~..common.losses.PolicyLoss`
with its inputs. Its derivatives are written out as autograd takes them through
``PolicyLoss.__call__``, operation for operation (``maximum`` / ``minimum`` give half the gradient
to each side of a tie; ``clamp`` passes it at its bounds, and none at NaN), so they agree with the
generic path to float32 rounding: ``exp`` and ``log`` are libdevice's on a GPU (torch's own), the
fast ``exp2`` form of ``tl.exp`` only under Triton's CPU interpreter.
"""

from __future__ import annotations

try:  # Triton is optional; the torch backend needs none of this.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


if triton is not None:
    from .triton_kernels import _logits_tile

    @triton.jit
    def _exp(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _log(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _clamp(x, lo, hi):
        """torch.clamp's value (NaN stays NaN) and its gradient's mask (bounds included)."""
        return (tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                           propagate_nan=tl.PropagateNan.ALL), (x >= lo) & (x <= hi))

    @triton.jit
    def _policy_term(lp, ent, old, adv, ref, w, lo, hi, dual_clip, kl_coef, entropy_coef, limit,
                     DUAL: tl.constexpr, KL: tl.constexpr, ENTROPY: tl.constexpr,
                     PRECISE: tl.constexpr):
        """``(w * f, w * df/dlp, w * df/dentropy)`` of PolicyLoss's ``f`` at one token, in the
        order of operations autograd runs through ``PolicyLoss.__call__`` (``lo``, ``hi``: the
        ratio's clamp bounds ``1 - clip_low``, ``1 + clip_high``; KL 0 none, 1 k1, 2 k3)."""
        delta = lp - old
        c, in_limit = _clamp(delta, -limit, limit)
        ratio = _exp(c, PRECISE)
        na = -adv
        a1 = na * ratio
        rc, in_clip = _clamp(ratio, lo, hi)
        a2 = na * rc
        pg = tl.maximum(a1, a2, propagate_nan=tl.PropagateNan.ALL)
        g = w  # d(w * f) / d f
        gpg = g
        if DUAL:
            bound = na * dual_clip
            gm = tl.where(pg > bound, 0.0, tl.where(pg == bound, g * 0.5, g))
            gpg = tl.where(adv < 0, gm, g)
            pg = tl.where(adv < 0, tl.minimum(pg, bound, propagate_nan=tl.PropagateNan.ALL), pg)
        ga1 = tl.where(a1 < a2, 0.0, tl.where(a1 == a2, gpg * 0.5, gpg))
        ga2 = tl.where(a1 > a2, 0.0, tl.where(a1 == a2, gpg * 0.5, gpg))
        gratio = ga1 * na + tl.where(in_clip, ga2 * na, 0.0)
        glp = tl.where(in_limit, gratio * ratio, 0.0)
        if KL == 1:
            pg = pg + kl_coef * (lp - ref)
            glp = glp + g * kl_coef
        if KL == 2:
            d0 = ref - lp
            d, in_d = _clamp(d0, -20.0, 20.0)
            e = _exp(d, PRECISE)
            kr = e - d - 1.0
            kl, in_kl = _clamp(kr, -10.0, 10.0)
            pg = pg + kl_coef * kl
            gkr = tl.where(in_kl, g * kl_coef, 0.0)
            glp = glp + -tl.where(in_d, gkr * e - gkr, 0.0)
        gent = 0.0
        if ENTROPY:
            pg = pg - entropy_coef * ent
            gent = -g * entropy_coef
        return pg * w, glp, gent

    @triton.jit
    def _row_loss_kernel(
        Z, DZ, COEF, LABEL, VALID, GM, GLOGS, GENT, GT, TW, OLD, ADV, REF, TERM, LP, ENT,
        V, stride_z, stride_dz, lo, hi, dual_clip, kl_coef, entropy_coef, limit,
        BLOCK: tl.constexpr, LOCAL: tl.constexpr, POLICY: tl.constexpr, DUAL: tl.constexpr,
        KL: tl.constexpr, ENTROPY: tl.constexpr, GRAD: tl.constexpr, PRECISE: tl.constexpr,
    ):
        """One token of a chunk: LOCAL, its statistics from its row (the whole vocabulary is
        this rank's), else the combined ones (GM max, GLOGS log s, GENT entropy, GT label
        logit); then its term, log-prob and entropy (0 where ignored), and with GRAD its logit
        gradient ``coef * d term / d l`` into DZ (input dtype)."""
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        coef = tl.load(COEF + row)
        label = tl.load(LABEL + row)
        valid = tl.load(VALID + row) != 0
        if LOCAL:  # as the generic path's row statistics, then its combine over one rank
            m = tl.max(tl.full([BLOCK], -1e30, dtype=tl.float32), axis=0)  # finite start
            s = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
            a = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
            for j in range(0, V, BLOCK):
                cols = j + tl.arange(0, BLOCK)
                cmask = cols < V
                l = tl.load(base + cols, mask=cmask, other=0.0) * coef
                l = tl.where(cmask, l, -1e30)  # past the end: exp underflows to 0, e * d is -0
                m_new = tl.maximum(m, tl.max(l, axis=0))
                alpha = tl.exp(m - m_new)
                d = l - m_new
                e = tl.exp(d)
                if ENTROPY:
                    a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=0)
                s = s * alpha + tl.sum(e, axis=0)
                m = m_new
            t = tl.where(label >= 0, tl.load(base + tl.maximum(label, 0)) * coef, 0.0)
            log_s = _log(s, PRECISE)
            ent = log_s - tl.math.div_rn(a, s)
        else:
            m = tl.load(GM + row)
            log_s = tl.load(GLOGS + row)
            ent = tl.load(GENT + row)
            t = tl.load(GT + row)
        lp = tl.where(valid, (t - m) - log_s, 0.0)
        ev = tl.where(valid, ent, 0.0)
        w = tl.load(TW + row)
        if POLICY:  # inputs of positions that do not count are 0 (as PerTokenLoss.bind)
            counts = valid & (w != 0)
            old = tl.where(counts, tl.load(OLD + row), 0.0)
            adv = tl.where(counts, tl.load(ADV + row), 0.0)
            ref = 0.0
            if KL != 0:
                ref = tl.where(counts, tl.load(REF + row), 0.0)
            term, g1, g2 = _policy_term(lp, ev, old, adv, ref, w, lo, hi, dual_clip, kl_coef,
                                        entropy_coef, limit, DUAL, KL, ENTROPY, PRECISE)
        else:  # the weighted NLL: -w * logprob
            term = -w * lp
            g1 = -w
            g2 = 0.0
        tl.store(TERM + row, tl.where(valid, term, 0.0))
        tl.store(LP + row, lp)
        if ENTROPY:
            tl.store(ENT + row, ev)
        if GRAD:
            g1 = tl.where(valid, g1, 0.0)
            out = DZ + row.to(tl.int64) * stride_dz
            if ENTROPY:  # log p + H = u + (H - log s), the row's own (unmasked) entropy
                g2 = tl.where(valid, g2, 0.0)
                shift = ent - log_s
            for j in range(0, V, BLOCK):
                cols = j + tl.arange(0, BLOCK)
                mask = cols < V
                u = tl.load(base + cols, mask=mask, other=0.0) * coef - m
                p = tl.exp(u - log_s)
                if ENTROPY:
                    dl = -p * (g1 + g2 * (u + shift))
                else:
                    dl = -p * g1
                dl += tl.where(cols == label, g1, 0.0)
                tl.store(out + cols, (dl * coef).to(DZ.dtype.element_ty), mask=mask)

    @triton.jit
    def _token_terms_kernel(
        LP, ENT, VALID, TW, OLD, ADV, REF, TERM, G1, G2, N, lo, hi, dual_clip, kl_coef,
        entropy_coef, limit, BLOCK: tl.constexpr, POLICY: tl.constexpr, DUAL: tl.constexpr,
        KL: tl.constexpr, ENTROPY: tl.constexpr, PRECISE: tl.constexpr,
    ):
        """The terms of BLOCK tokens from their log-probs and entropies (the statistics pass's),
        and the terms' derivatives in them (0 where ignored): the loss when its gradients are
        formed in the backward (the logits recomputed there)."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < N
        valid = tl.load(VALID + rows, mask=mask, other=0) != 0
        lp = tl.load(LP + rows, mask=mask, other=0.0)
        ent = tl.load(ENT + rows, mask=mask, other=0.0)
        w = tl.load(TW + rows, mask=mask, other=0.0)
        if POLICY:  # inputs of positions that do not count are 0 (as PerTokenLoss.bind)
            counts = valid & (w != 0)
            old = tl.where(counts, tl.load(OLD + rows, mask=mask, other=0.0), 0.0)
            adv = tl.where(counts, tl.load(ADV + rows, mask=mask, other=0.0), 0.0)
            ref = tl.zeros([BLOCK], dtype=tl.float32)
            if KL != 0:
                ref = tl.where(counts, tl.load(REF + rows, mask=mask, other=0.0), 0.0)
            term, g1, g2 = _policy_term(lp, ent, old, adv, ref, w, lo, hi, dual_clip, kl_coef,
                                        entropy_coef, limit, DUAL, KL, ENTROPY, PRECISE)
        else:  # the weighted NLL: -w * logprob
            term = -w * lp
            g1 = -w
            g2 = 0.0
        zero = tl.zeros([BLOCK], dtype=tl.float32)  # a scalar 0 derivative made a vector
        tl.store(TERM + rows, tl.where(valid, term, 0.0), mask=mask)
        tl.store(G1 + rows, tl.where(valid, g1, 0.0), mask=mask)
        tl.store(G2 + rows, tl.where(valid, g2 + zero, 0.0), mask=mask)

    # The fused losses' logits: fp32 Z = X @ W.T ([N, H] x [V, H]) with the statistics kernel's
    # tile loop, so a logit's sum over H runs in one order whatever N (cuBLAS's did not for
    # every shape: benchmarks/RESULTS.md). Vocabulary tile slowest: the row blocks of a chunk
    # (its X stays in L2) run together over each weight tile, read from memory once.
    @triton.jit
    def _logits_kernel(
        X, W, Z, N, V, H, stride_x, stride_w, stride_z,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row_blocks = tl.cdiv(N, BLOCK_N)
        pid_n = pid % row_blocks
        pid_v = pid // row_blocks
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask, cmask = rows < N, cols < V
        z = _logits_tile(X, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, pid_v * BLOCK_V, H,
                         stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, USE_TMA)
        tl.store(Z + rows[:, None].to(tl.int64) * stride_z + cols[None, :], z,
                 mask=rmask[:, None] & cmask[None, :])

    # Row passes of the losses with gradients formed in the forward, over one chunk's
    # materialised fp32 logits (raw x @ W.T; coef applied on load). One program per row;
    # memory-bound.
    @triton.jit
    def _row_stats_kernel(Z, COEF, LABEL, M, S, A, T, V, stride_z, BLOCK: tl.constexpr,
                          ENTROPY: tl.constexpr):
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        coef = tl.load(COEF + row)
        label = tl.load(LABEL + row)
        m = tl.max(tl.full([BLOCK], -1e30, dtype=tl.float32), axis=0)  # finite start, as above
        s = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
        a = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
        for j in range(0, V, BLOCK):
            cols = j + tl.arange(0, BLOCK)
            cmask = cols < V
            l = tl.load(base + cols, mask=cmask, other=0.0) * coef
            l = tl.where(cmask, l, -1e30)  # past the end: exp underflows to 0, e * d is -0
            m_new = tl.maximum(m, tl.max(l, axis=0))
            alpha = tl.exp(m - m_new)
            d = l - m_new
            e = tl.exp(d)
            if ENTROPY:
                a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=0)
            s = s * alpha + tl.sum(e, axis=0)
            m = m_new
        t = tl.load(base + tl.maximum(label, 0)) * coef
        tl.store(M + row, m)
        tl.store(S + row, s)
        tl.store(A + row, a)
        tl.store(T + row, tl.where(label >= 0, t, 0.0))

    @triton.jit
    def _row_grad_kernel(Z, DZ, COEF, LABEL, M, LOGS, G1, G2, ENT, V, stride_z, stride_dz,
                         BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        out = DZ + row.to(tl.int64) * stride_dz
        coef = tl.load(COEF + row)
        label = tl.load(LABEL + row)
        m = tl.load(M + row)
        log_s = tl.load(LOGS + row)
        g1 = tl.load(G1 + row)
        if ENTROPY:  # log p + H = u + (H - log s)
            g2 = tl.load(G2 + row)
            shift = tl.load(ENT + row) - log_s
        for j in range(0, V, BLOCK):
            cols = j + tl.arange(0, BLOCK)
            mask = cols < V
            u = tl.load(base + cols, mask=mask, other=0.0) * coef - m
            p = tl.exp(u - log_s)
            if ENTROPY:
                dl = -p * (g1 + g2 * (u + shift))
            else:
                dl = -p * g1
            dl += tl.where(cols == label, g1, 0.0)
            tl.store(out + cols, (dl * coef).to(DZ.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_cast_kernel(X, G, OUT, n, BLOCK: tl.constexpr):
        """``OUT = X * G[0]`` (``X`` float32, or 16-bit: a kept logit gradient; a float32
        scalar's one element ``G``) in float32, rounded once to OUT's dtype: the fused losses'
        gradients times the upstream gradient. (torch's mul of mixed dtypes takes a path at a
        fraction of the memory bandwidth's speed.)"""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G)
        x = tl.load(X + offs, mask=mask, other=0.0)
        tl.store(OUT + offs, (x * g).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_accumulate_kernel(X, G, ACC, n, BLOCK: tl.constexpr):
        """``ACC += X * G[0]`` in float32: a fused loss's float32 weight gradient, formed in the
        forward, added into Megatron's main_grad once the backward knows the upstream gradient."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G)
        acc = tl.load(ACC + offs, mask=mask, other=0.0)
        tl.store(ACC + offs, acc + tl.load(X + offs, mask=mask, other=0.0) * g, mask=mask)
