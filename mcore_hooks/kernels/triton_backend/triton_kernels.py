"""The Triton backend's kernels (:mod:`.triton_fused` launches them; see its docstring for the
design): the prologue, the statistics pass and its segment merge, the logit-gradient pass, the
hidden states' gradient, and the given ids' gathers (the fused losses' own: :mod:`.triton_losses`).
Plain tensors and constexpr tile shapes in, nothing chosen here.
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
        X, W, COEF, M, S, A,
        N, V, H, stride_x, stride_w, stride_p, seg_tiles, segments, segs_per_split, splits, group,
        coef_scalar,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        USE_TMA: tl.constexpr, SCALAR_COEF: tl.constexpr,
    ):
        # Programs in groups of `group` row blocks x `splits`, split index fastest: the programs
        # running together (about one group fills the GPU) share a few row blocks (their X stays
        # in L2) and walk neighbouring vocab ranges together, instead of 100+ row blocks
        # re-reading X from memory for every vocab tile. Groups run one after another in one
        # launch (a launch per group cost a Python round trip each).
        pid = tl.program_id(0)
        per_group = group * splits
        pid_n = pid // per_group * group + pid % per_group // splits
        pid_s = pid % splits
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        if SCALAR_COEF:  # one coefficient for every token (a float temperature; the prologue's value)
            coef = coef_scalar + tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            coef = tl.load(COEF + rows, mask=rmask, other=1.0)
        vtiles = tl.cdiv(V, BLOCK_V)
        # A split walks whole segments and stores each one's statistics apart (segment i of
        # token r at i * stride_p + r): a token's arithmetic is fixed by the segments (the
        # vocabulary's), never by the split. One loop over the tiles, as without segments.
        t0 = pid_s * segs_per_split * seg_tiles
        # Finite start: (m_old - m_new) * s stays 0, never -inf * 0, before the first tile.
        m = tl.full([BLOCK_N], -1e30, dtype=tl.float32)
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        a = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(0, segs_per_split * seg_tiles):
            vt = t0 + j
            col0 = vt * BLOCK_V
            cols = col0 + tl.arange(0, BLOCK_V)
            cmask = cols < V
            # Columns past the vocabulary get -1e30: exp underflows to 0 and e * d is -0, so no
            # per-element masking is needed (each segment's first tile has a real column, so m
            # is finite and real before any all-padding tile).
            bias = tl.where(cmask, 0.0, -1e30)
            l = _logits_tile(X, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, col0, H,
                             stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                             USE_TMA) * coef[:, None] + bias[None, :]
            m_new = tl.maximum(m, tl.max(l, axis=1))
            alpha = tl.exp(m - m_new)
            d = l - m_new[:, None]
            e = tl.exp(d)
            a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            m = m_new
            # A segment's last tile: store, start the next segment afresh (selects, not a
            # branch; tiles past the vocabulary's end, in the last split, store nothing).
            last = (((vt + 1) % seg_tiles == 0) | (vt + 1 == vtiles)) & (vt < vtiles)
            # 64-bit: segments x N passes int32 from 8.4M tokens at 256 segments
            out = (vt // seg_tiles).to(tl.int64) * stride_p + rows
            # the flag as a vector (Triton's interpreter refuses a scalar in a store's mask)
            smask = rmask & (tl.zeros([BLOCK_N], dtype=tl.int32) + last.to(tl.int32) != 0)
            tl.store(M + out, m, mask=smask)
            tl.store(S + out, s, mask=smask)
            tl.store(A + out, a, mask=smask)
            m = tl.where(last, -1e30, m)
            s = tl.where(last, 0.0, s)
            a = tl.where(last, 0.0, a)

    @triton.jit
    def _merged(M, S, A, cols, mask, N, segments):
        """A block of tokens' segment statistics added in segment order (a fixed order, whatever
        the number of tokens: a reduction's order in PyTorch may follow the shape)."""
        # The pointers step by N a segment (64-bit: i * N in int32 would pass 2^31 from 8.4M
        # tokens at 256 segments).
        m = tl.full(cols.shape, -float("inf"), dtype=tl.float32)
        pm = M + cols
        for i in range(0, segments):
            m = tl.maximum(m, tl.load(pm, mask=mask, other=0.0))
            pm += N
        s = tl.zeros(cols.shape, dtype=tl.float32)
        a = tl.zeros(cols.shape, dtype=tl.float32)
        pm, ps, pa = M + cols, S + cols, A + cols
        for i in range(0, segments):
            mi = tl.load(pm, mask=mask, other=0.0)
            si = tl.load(ps, mask=mask, other=0.0)
            ai = tl.load(pa, mask=mask, other=0.0)
            pm += N
            ps += N
            pa += N
            shift = mi - m
            alpha = tl.exp(shift)
            s += si * alpha
            a += (ai + shift * si) * alpha
        return m, s, a

    @triton.jit
    def _label_logits(X, W, COEF, LABEL, rows, mask, H, stride_x, stride_w, BLOCK_H: tl.constexpr):
        """``coef * x[row] . W[label]`` in fp32 for a block of tokens (0 where the label is not
        this shard's), ``coef`` and the label read from memory (:func:`_label_logit_values`)."""
        return _label_logit_values(X, W, tl.load(COEF + rows, mask=mask, other=1.0),
                                   tl.load(LABEL + rows, mask=mask, other=-1), rows, mask, H,
                                   stride_x, stride_w, BLOCK_H)

    @triton.jit
    def _label_logit_values(X, W, coef, label, rows, mask, H, stride_x, stride_w, BLOCK_H: tl.constexpr):
        """``coef * x[row] . W[label]`` in fp32 for a block of tokens (0 where the label is -1):
        each token's products added lane by lane over the hidden size, then across the lanes,
        in one order whatever its place in the block or the call's size."""
        owned = mask & (label >= 0)
        x_row = X + rows.to(tl.int64)[:, None] * stride_x
        w_row = W + tl.where(owned, label, 0).to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([rows.shape[0], BLOCK_H], dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            offs = k + tl.arange(0, BLOCK_H)
            m2 = owned[:, None] & (offs < H)[None, :]
            x = tl.load(x_row + offs[None, :], mask=m2, other=0.0)
            w = tl.load(w_row + offs[None, :], mask=m2, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)
        return tl.sum(acc, axis=1) * coef

    @triton.jit
    def _merge_segments_kernel(M, S, A, X, W, COEF, LABEL, OM, OS, OA, OT, N, segments, H, stride_x,
                               stride_w, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        """The statistics of this rank's vocabulary (to be combined over the group), and the
        label's logit where this rank holds it."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        m, s, a = _merged(M, S, A, cols, mask, N, segments)
        tl.store(OM + cols, m, mask=mask)
        tl.store(OS + cols, s, mask=mask)
        tl.store(OA + cols, a, mask=mask)
        tl.store(OT + cols, _label_logits(X, W, COEF, LABEL, cols, mask, H, stride_x, stride_w, BLOCK_H),
                 mask=mask)

    @triton.jit
    def _merge_final_kernel(M, S, A, X, W, COEF, LABEL, VALID, LP, ENT, LOGZ, BEST, OM, OLOGS, N,
                            segments, H, stride_x, stride_w, GLOBAL, ignore_index, v_total,
                            vocab_start, v_local, coef_scalar, BLOCK: tl.constexpr,
                            BLOCK_H: tl.constexpr, PRECISE: tl.constexpr, PROLOGUE: tl.constexpr):
        """The whole vocabulary's statistics (one rank), finished as ``autograd.combine`` and
        the statistics op finish them over a group: log-prob and entropy (0 where ignored),
        log Z, whether the label is the row's maximum (``autograd.label_is_row_max``), and the
        max and log s the backward takes; the label's logit formed here (no launch of its own).

        ``PROLOGUE``: the prologue's work too (no launch of its own): from the global labels
        ``GLOBAL`` and the scalar coefficient, each token's validity, coefficient and local row
        stored to ``VALID``, ``COEF`` and ``LABEL`` as ``_prologue_kernel`` stores them (the
        statistics kernel took the scalar). A label outside the vocabulary makes every result
        of its token NaN, as the prologue's NaN coefficient does in the statistics kernel."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        m, s, a = _merged(M, S, A, cols, mask, N, segments)
        s = tl.where(mask, s, 1.0)  # lanes past the end: no log of 0
        if PRECISE:  # torch.log's own (libdevice); the interpreter has numpy's
            log_s = libdevice.log(s)
        else:
            log_s = tl.log(s)
        ent = log_s - tl.math.div_rn(a, s)
        if PROLOGUE:
            y = tl.load(GLOBAL + cols, mask=mask, other=0).to(tl.int64)
            valid = y != ignore_index
            bad = valid & ((y < 0) | (y >= v_total))
            local = y - vocab_start
            label = tl.where(valid & (local >= 0) & (local < v_local), local, -1)
            coef = tl.where(bad, float("nan"), coef_scalar + tl.zeros([BLOCK], dtype=tl.float32))
            tl.store(VALID + cols, valid, mask=mask)
            tl.store(COEF + cols, coef, mask=mask)
            tl.store(LABEL + cols, label, mask=mask)
            m = tl.where(bad, float("nan"), m)
            log_s = tl.where(bad, float("nan"), log_s)
            ent = tl.where(bad, float("nan"), ent)
            t = _label_logit_values(X, W, coef, label, cols, mask, H, stride_x, stride_w, BLOCK_H)
        else:
            t = _label_logits(X, W, COEF, LABEL, cols, mask, H, stride_x, stride_w, BLOCK_H)
            valid = tl.load(VALID + cols, mask=mask, other=0) != 0
        best = t >= m - tl.maximum(tl.abs(m), 1.0) * 9.5367431640625e-07  # 2**-20
        tl.store(LP + cols, tl.where(valid, (t - m) - log_s, 0.0), mask=mask)
        tl.store(ENT + cols, tl.where(valid, ent, 0.0), mask=mask)
        tl.store(LOGZ + cols, m + log_s, mask=mask)
        tl.store(BEST + cols, valid & best, mask=mask)
        tl.store(OM + cols, m, mask=mask)
        tl.store(OLOGS + cols, log_s, mask=mask)

    @triton.jit
    def _upstream(ptrs, valid, HAS: tl.constexpr):
        """An upstream gradient at a block of rows, 0 where the token is ignored (never read
        there: NaN is no input) or where there is none (``HAS`` False)."""
        if HAS:
            g = tl.load(ptrs, mask=valid, other=0.0)
        else:
            g = tl.zeros(valid.shape, dtype=tl.float32)
        return g

    @triton.jit
    def _grad_rows(COEF, M, LOGS, ENT, G1, G2, LABEL, VALID, rows, rmask, stride_g1, stride_g2,
                   HAS_G1: tl.constexpr, HAS_G2: tl.constexpr):
        """A block of rows' logit gradient inputs: coef, the forward's max, log s and entropy,
        the upstream gradients of log-prob and entropy (:func:`_upstream`; any stride, 0 for
        one value broadcast, as a sum's backward gives it: no copy made first), the label (-1:
        none)."""
        valid = rmask & (tl.load(VALID + rows, mask=rmask, other=0) != 0)
        return (tl.load(COEF + rows, mask=rmask, other=1.0), tl.load(M + rows, mask=rmask, other=0.0),
                tl.load(LOGS + rows, mask=rmask, other=0.0), tl.load(ENT + rows, mask=rmask, other=0.0),
                _upstream(G1 + rows.to(tl.int64) * stride_g1, valid, HAS_G1),
                _upstream(G2 + rows.to(tl.int64) * stride_g2, valid, HAS_G2),
                tl.load(LABEL + rows, mask=rmask, other=-1))

    @triton.jit
    def _dlogits(u, cols, label, log_s, ent, g1, g2):
        """d/dl of g1*logprob + g2*entropy at ``u = l - max`` (``cols``: the columns' global ids,
        broadcast against the rows); the caller multiplies by coef (l = coef * z).

        log p = u - log s, never l - logZ (see autograd's docstring); exp as tl.exp computes it
        (ex2 of a log2e-scaled argument), with that scaling and the log s shift in one fma, so
        a tile costs no more than with a single logZ. log p + entropy = u + (entropy - log s).
        """
        p = tl.exp2(u * 1.4426950408889634 - (log_s * 1.4426950408889634)[:, None])
        dl = -p * (g1[:, None] + g2[:, None] * (u + (ent - log_s)[:, None]))
        return dl + tl.where(cols == label[:, None], g1[:, None], 0.0)

    @triton.jit
    def _dlogits_kernel(
        X, W, COEF, LABEL, VALID, M, LOGS, ENT, G1, G2, DZ,
        N, V, H, v0, Vc, stride_x, stride_w, stride_dz, stride_g1, stride_g2,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        USE_TMA: tl.constexpr, GROUP: tl.constexpr, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr,
    ):
        # GROUP row blocks walk the chunk's vocab tiles together (row block fastest): the
        # programs running together share a few X blocks and each W tile, read from memory
        # once a group. A chunk's W is most of the vocabulary's (hundreds of MB, not L2's): with
        # the vocab tile fastest every row block re-read it, and the kernel ran at memory speed
        # (57.9 ms at 16384 x 4096 x 151936 on an H100, the statistics kernel's same product 41.8).
        pid = tl.program_id(0)
        row_blocks = tl.cdiv(N, BLOCK_N)
        per_group = GROUP * tl.cdiv(Vc, BLOCK_V)
        first = pid // per_group * GROUP
        size = tl.minimum(row_blocks - first, GROUP)
        pid_n = first + pid % per_group % size
        pid_v = pid % per_group // size
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols_local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v0 + cols_local
        cmask = (cols_local < Vc) & (cols < V)
        coef, m, log_s, ent, g1, g2, label = _grad_rows(COEF, M, LOGS, ENT, G1, G2, LABEL, VALID, rows,
                                                        rmask, stride_g1, stride_g2, HAS_G1, HAS_G2)
        # Under TMA a tile may run past the chunk into the next one's rows; those columns are
        # computed and then masked (cmask), never stored.
        u = _logits_tile(X, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, v0 + pid_v * BLOCK_V,
                         H, stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K,
                         USE_TMA) * coef[:, None] - m[:, None]
        dz = _dlogits(u, cols[None, :], label, log_s, ent, g1, g2) * coef[:, None]
        ptr = DZ + rows[:, None].to(tl.int64) * stride_dz + cols_local[None, :]
        tl.store(ptr, dz.to(DZ.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    # dX = dz @ W ([N, V] @ [V, H]) with its sum over the vocabulary in a fixed shape: the
    # vocabulary is cut into segments (from its size alone: triton_fused.dx_segment), each
    # segment's partial sum formed from 0 tile after tile, the partials added in segment order
    # (((P0 + P1) + P2) + ...). A program may form its tile's partials one after another and
    # add them in registers (SPLIT False), or form one segment's partial for the merge kernel
    # to add (SPLIT True: more programs where the tokens are few, the same bits); a call may
    # cut the vocabulary into chunks of whole segments, carrying the float32 sum between them
    # (CONTINUE: the chunks before have left it in ACC). cuBLAS splits the sum (split-K) by the
    # number of rows: a token's dX row then changed with the call's size (H100, measured;
    # benchmarks/profile_invariant.py --sections fused).
    @triton.jit
    def _segment_partial(DZ, W, rows, cols, rmask, cmask, row0, col0, k0, k_end, stride_dz, stride_w,
                         BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_TMA: tl.constexpr):
        """fp32 ``dz[rows, k0:k_end] @ W[k0:k_end, cols]``, from 0, tile after tile (DZ, W: the
        chunk's; TMA zero-fills past its end, the pointer loads mask)."""
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        if USE_TMA:
            for k in range(k0, k_end, BLOCK_K):
                a = DZ.load([row0, k])
                b = W.load([k, col0])
                acc = tl.dot(a, b, acc)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            for k in range(k0, k_end, BLOCK_K):
                kmask = offs_k < k_end - k
                a = tl.load(DZ + rows[:, None].to(tl.int64) * stride_dz + (k + offs_k)[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(W + (k + offs_k)[:, None].to(tl.int64) * stride_w + cols[None, :],
                            mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _hidden_grad_kernel(
        DZ, W, ACC, OUT, PARTS, N, H, V, seg_cols, segments, stride_dz, stride_w, stride_o,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_TMA: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, CONTINUE: tl.constexpr,
    ):
        """This chunk's ``segments`` (of ``seg_cols`` columns, V in all) of dX: SPLIT, program
        (tile, segment) stores the segment's partial in PARTS[segment]; else program (tile)
        adds them in order to the sum (ACC's with CONTINUE) and stores it to OUT (float32, or
        the input dtype after the last chunk: rounded once). Contiguous [N, H] ACC/OUT/PARTS."""
        pid = tl.program_id(0)
        row_blocks = tl.cdiv(N, BLOCK_N)
        per_group = GROUP * tl.cdiv(H, BLOCK_V)
        seg = 0
        if SPLIT:  # segment slowest: the programs running together share a segment's W tiles
            seg = pid // (row_blocks * tl.cdiv(H, BLOCK_V))
            pid = pid % (row_blocks * tl.cdiv(H, BLOCK_V))
        # GROUP row blocks walk the vocabulary together: their dz and W tiles are read from L2
        first = pid // per_group * GROUP
        size = tl.minimum(row_blocks - first, GROUP)
        pid_n = first + pid % per_group % size
        pid_h = pid % per_group // size
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = pid_h * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask, cmask = rows < N, cols < H
        omask = rmask[:, None] & cmask[None, :]
        at = rows[:, None].to(tl.int64) * stride_o + cols[None, :]
        if SPLIT:
            k0 = seg * seg_cols
            part = _segment_partial(DZ, W, rows, cols, rmask, cmask, pid_n * BLOCK_N, pid_h * BLOCK_V,
                                    k0, tl.minimum(k0 + seg_cols, V), stride_dz, stride_w,
                                    BLOCK_N, BLOCK_V, BLOCK_K, USE_TMA)
            tl.store(PARTS + seg.to(tl.int64) * N * H + at, part, mask=omask)
        else:
            if CONTINUE:
                total = tl.load(ACC + at, mask=omask, other=0.0)
            else:
                total = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
            for s in range(0, segments):
                k0 = s * seg_cols
                part = _segment_partial(DZ, W, rows, cols, rmask, cmask, pid_n * BLOCK_N,
                                        pid_h * BLOCK_V, k0, tl.minimum(k0 + seg_cols, V),
                                        stride_dz, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, USE_TMA)
                if CONTINUE:
                    total = total + part
                else:  # the call's first segment is the sum itself (no 0 + P0: its zeros' sign)
                    total = tl.where(s == 0, part, total + part)
            tl.store(OUT + at, total.to(OUT.dtype.element_ty), mask=omask)

    @triton.jit
    def _merge_partials_kernel(PARTS, ACC, OUT, NH, segments, BLOCK: tl.constexpr,
                               CONTINUE: tl.constexpr):
        """The SPLIT partials added in segment order, as the sequential form adds them."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NH
        part = PARTS + offs  # 64-bit pointers: segments x N x H may pass 2**31
        if CONTINUE:
            total = tl.load(ACC + offs, mask=mask, other=0.0) + tl.load(part, mask=mask, other=0.0)
        else:
            total = tl.load(part, mask=mask, other=0.0)
        for s in range(1, segments):
            part += NH
            total = total + tl.load(part, mask=mask, other=0.0)
        tl.store(OUT + offs, total.to(OUT.dtype.element_ty), mask=mask)

    # Given ids' columns of the logit gradient (``selected_ids``: their logits' gradients g).
    # The tiles leave them out: a K-wide compare over every tile cost a third of the backward,
    # for K entries a row. Their values are made once from the forward's float32 logits of the
    # ids, by the tiles' formula, then written over each vocabulary chunk's tiles.
    @triton.jit
    def _given_dlogits_kernel(
        COLS, G, L, COEF, LABEL, VALID, M, LOGS, ENT, G1, G2, OUT, N, K, stride_g1, stride_g2,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rmask = rows < N
        mask = rmask[:, None] & (ks < K)[None, :]
        at = rows.to(tl.int64)[:, None] * K + ks[None, :]
        cols = tl.load(COLS + at, mask=mask, other=-1)
        coef, m, log_s, ent, g1, g2, label = _grad_rows(COEF, M, LOGS, ENT, G1, G2, LABEL, VALID, rows,
                                                        rmask, stride_g1, stride_g2, HAS_G1, HAS_G2)
        dl = _dlogits(tl.load(L + at, mask=mask, other=0.0) - m[:, None], cols, label, log_s, ent, g1, g2)
        for j in range(0, K):  # every entry naming the column (ids may repeat), in order
            c = tl.load(COLS + rows.to(tl.int64) * K + j, mask=rmask, other=-1)
            g = tl.load(G + rows.to(tl.int64) * K + j, mask=rmask, other=0.0)
            dl += tl.where(cols == c[:, None], g[:, None], 0.0)
        tl.store(OUT + at, (dl * coef[:, None]).to(OUT.dtype.element_ty), mask=mask)

    # x_i . W[rows_ik] for given rows (``selected_ids``' logits): one token and BLOCK_K of its
    # rows a program, float32 products summed in one fixed order (batch-invariant by
    # construction). Memory-bound: K weight rows a token, read once, not copied first.
    @triton.jit
    def _gathered_dots_kernel(X, W, ROWS, OUT, K, H, stride_x, stride_w,
                              BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < K
        rows = tl.load(ROWS + i * K + ks, mask=kmask, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            hmask = offs < H
            x = tl.load(X + i * stride_x + offs, mask=hmask, other=0.0)
            w = tl.load(W + rows[:, None] * stride_w + offs[None, :],
                        mask=kmask[:, None] & hmask[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(OUT + i * K + ks, tl.sum(acc, axis=1), mask=kmask)

    @triton.jit
    def _write_columns_kernel(DZ, COLS, VAL, N, K, v0, Vc, stride_dz,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < N)[:, None] & (ks < K)[None, :]
        at = rows.to(tl.int64)[:, None] * K + ks[None, :]
        local = tl.load(COLS + at, mask=mask, other=-1) - v0
        inside = mask & (local >= 0) & (local < Vc)  # -1 (none) is below every v0 >= 0
        # a repeated id writes its one value twice
        tl.store(DZ + rows.to(tl.int64)[:, None] * stride_dz + local,
                 tl.load(VAL + at, mask=inside, other=0.0), mask=inside)

    @triton.jit
    def _prologue_kernel(LABELS, TEMP, VALID, COEF, LOCAL, N, ignore_index, v_total, vocab_start,
                         v_local, scale, coef_scalar, BLOCK: tl.constexpr, PER_TOKEN: tl.constexpr):
        """The entry points' per-token inputs in the kernels' form, in one launch (the torch
        form in ``arguments._prepare`` takes a dozen): whether a label counts, the logits'
        coefficient ``scale / temperature`` (NaN for a label outside the vocabulary or a
        temperature not positive and finite: bad input never gives a plausible number; 0 for
        an ignored token's bad temperature, never read), and
        the label as a row of this rank's shard (-1 where not owned or not counted)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        y = tl.load(LABELS + offs, mask=mask, other=0).to(tl.int64)
        valid = y != ignore_index
        bad = valid & ((y < 0) | (y >= v_total))
        if PER_TOKEN:
            t = tl.load(TEMP + offs, mask=mask, other=1.0)
            # torch's scale / t for a Python scale: reciprocal(t) * scale (two roundings)
            one = tl.full([BLOCK], 1.0, dtype=tl.float32)
            # an ignored token's temperature is never read: 0, it adds exactly nothing
            c = tl.where((t > 0) & (t < float("inf")), tl.math.div_rn(one, t) * scale,
                         tl.where(valid, float("nan"), 0.0))
        else:
            c = coef_scalar + tl.zeros([BLOCK], dtype=tl.float32)
        local = y - vocab_start
        owned = valid & (local >= 0) & (local < v_local)
        tl.store(VALID + offs, valid, mask=mask)
        tl.store(COEF + offs, tl.where(bad, float("nan"), c), mask=mask)
        tl.store(LOCAL + offs, tl.where(owned, local, -1), mask=mask)
