"""Triton backend: the two passes of :mod:`..common.autograd` with the logits fused into the matmul (the
kernels are in :mod:`.triton_kernels`; their launches, tiles and grids here).

Launches are a fixed handful per pass, whatever the shape (a Python loop over vocabulary or
token chunks would make the host's work grow with V / H or N: 652 launches a call at hidden 896
before, longer on the host than on the GPU below 2048 tokens; ``benchmarks/bench_sweep.py``).

Prologue (:meth:`TritonFused.prologue`): the labels' validity, the logits' coefficients
``logit_scale / temperature`` and this rank's label rows, one launch. The log-prob pass on one
rank with a float temperature folds it into its own launches instead
(:meth:`TritonFused.stats_with_prologue`: the statistics kernel takes the coefficient as a
scalar, the merge forms the rest).

Forward (``stats``, ``local_stats``): one launch of the statistics kernel, its programs in groups
of 2048 tokens x vocab splits. Each program computes a ``[BLOCK_N, BLOCK_V]`` logits tile with
``tl.dot`` over the hidden size (fp32 accumulators), scales it by ``coef`` and folds it into
running per-row max / sum-exp / entropy term held in registers; logits never reach memory. The
vocabulary is cut into fixed segments (:func:`vocab_segments`, from its size alone); a program
walks whole segments and stores each one's statistics (``[segments, N]``, up to 3 KiB a token),
which a small kernel adds in segment order (on one rank it also finishes them: log-prob,
entropy, log Z). That merge also forms the label's logit, one fp32 dot per token (kept out of
the tiles' epilogue, and given no launch of its own). So a token's statistics are the same bits
whatever the number of tokens, which only sets how many segments a program walks. Any
vocabulary size: tiles past the end are masked, no divisibility is assumed.

Backward (``grads``): the vocabulary is walked in chunks of whole dX segments
(:func:`dx_segment`), as many as a 1 GiB buffer of the logit gradient holds (one chunk up to
3449 tokens at a 151936-token vocabulary). A kernel recomputes the chunk's ``[N, Vc]`` logits
tile by tile and writes their gradient ``dz`` (input dtype) once; cuBLAS forms
``dW[chunk] = dz.T @ X`` in one call (a single rounding, K = N; into ``main_grad`` with float32
accumulation where one is given); ``_hidden_grad_kernel`` adds ``dz @ W[chunk]`` to dX. dX's sum
over the vocabulary has one fixed shape (each segment's partial from 0, the partials added in
order), whether one program adds a tile's segments or a program per segment and a merge do (few
tokens: more programs), and whatever the chunks: a token's dX row is the same bits in any call.
No atomics: results are deterministic.

The fused losses (:meth:`~..common.autograd.Backend.fused_loss`: gradients formed in the forward, at
every hidden size, :attr:`TritonFused.forward_gradients_min_hidden`) take from here the chunk's
float32 logits (``_logits_kernel``, the statistics kernel's tile loop), one row kernel that forms
each token's statistics, loss term and derivatives and its logit gradient
(:mod:`.triton_losses`), dX (``_hidden_grad_kernel``), and for few tokens dW formed in the
backward from the kept logit gradient (cuBLAS's, the logit gradient scaled by the upstream
gradient first, as stock's backward: ``loss_op._weight_grad``). Without a gradient, or a loss
given as a Python function adding into an accumulator, a fused loss takes the statistics pass,
the per-token terms kernel and the backward above. dW, a sum over tokens, is cuBLAS's either way.

The fused losses' row and per-token launches, the prologue's, the scaling passes and the rule
for keeping a logit gradient live in :mod:`.triton_rows` (:class:`~.triton_rows.TritonRows`, a
base of :class:`TritonFused`).

Tile shapes depend on the GPU: :data:`~.triton_tiles.TILES` holds one set per family (sm_90,
sm_80, sm_86/89), chosen by compute capability and the per-block shared memory the device offers
(:func:`~.triton_tiles.device_tiles`); where none fits, or below compute capability 8.0, ``backend="auto"`` takes
the torch backend. bf16/fp16 inputs only (fp32 inputs use the torch backend, whose fp32 matmuls
are exact).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

from ..common.autograd import Backend, LocalStats, rows_of
from .triton_tiles import TILES, Tile, Tiles, _num_sms, cdiv
from .triton_rows import TritonRows
from ..common.matmul import addmm_f32_

try:  # Triton is optional; the torch backend needs none of this.
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
try:  # host-side tensor descriptors (TMA on Hopper), Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


# The log-prob backward's logit gradient is made a vocabulary chunk [N, Vc] at a time (input
# dtype), at most this many bytes (chunks are whole dX segments: one segment where even that
# passes it): one chunk (three launches: the gradient, dW, dX) up to 3449 tokens at a
# 151936-token vocabulary, 16 (a 9728-column segment each) at 32768. Chunks of H columns (the
# old rule, to keep the chunk inside the dX output) took 3 launches per H columns: 652 launches
# a call at hidden 896, the host's work longer than the GPU's below 2048 tokens.
_BWD_CHUNK_BYTES = 1 << 30
# Fewest vocab splits of the forward grid: 4 measured fastest with TMA loads (32.9 ms, against
# 35.1 at 8; benchmarks/results/profile_kernels_h200.log; measured on one launch over the whole
# call, before the programs in groups of _FWD_GROUP tokens).
_MIN_SPLITS = 4
# Segments the statistics kernel cuts the vocabulary into (the last may be shorter): each
# token's statistics are formed per segment and added in segment order, so they do not depend
# on the number of tokens (which only sets how many segments one program walks). Their
# [3, segments, N] float32 statistics are up to 3 KiB a token (2.3 at 151936: 198 segments of 3
# tiles). Fine segments fill the GPU at few tokens and balance a tensor-parallel shard's splits;
# at 32 a 256-token call left half the SMs idle (64 programs), and a TP 2 / 4 shard's 10- or
# 5-tile segments gave its 8 splits 4 segments where 3.75 was the mean. 256 against 32, H200,
# the statistics pass (kernel and merge), ms (benchmarks/profile_kernels.py --segments 32 256,
# benchmarks/results/profile_kernels_h200.log):
#   - 256 tokens x 151936: 0.856 -> 0.606 (hidden 4096), 1.628 -> 1.171 (8192);
#   - 16384 x 4096, TP shards of 151936: 17.72 -> 16.22 (V/2), 8.63 -> 7.93 (V/4), 4.63 -> 4.32 (V/8);
#   - full vocabularies (151936, 128256, 64128, 32000) and 512-2048 tokens: within 3% either way
#     in that run (an earlier one: 4.9% slower at 128256; benchmarks/results/profile_kernels_h200.log);
#   - 512 x 1536 x 32000: 0.125 -> 0.151 (the merge walks 125 segments; that call is bound by
#     the host's 1 ms, not the GPU's; benchmarks/results/profile_kernels_h200.log).
_SEGMENTS = 256
# Tokens per group of the statistics kernel's programs (16 row blocks of 128: with the splits
# that fill an H100/H200 once, one wave; the groups follow one another in one launch).
_FWD_GROUP = 2048
# Tokens per program of the segments' merge, and hidden columns per step of its label dot
# products (a [32, 128] float32 tile of products a step; the label's logit has no launch of its
# own: one launch a call less, some 30 us of host at RL's small calls).
_MERGE_BLOCK = 32
_LABEL_BLOCK_H = 128
# The given ids' gradient kernels: [rows, ids] per program (small: they touch N x K entries).
_GIVEN_ROWS, _GIVEN_COLS = 32, 32
# Row blocks of the hidden gradient's programs that walk the vocabulary together.
_DX_GROUP = 8
# Row blocks of the logit-gradient kernel's programs that walk a chunk's vocab tiles together.
_DZ_GROUP = 8
# Segments the hidden gradient's sum over the vocabulary is cut into (from the vocabulary's
# size alone; each a multiple of 256 columns): fixed, so a token's dX row is the same bits
# whether a program adds a tile's segments itself or programs form one segment each for a
# merge, which fills the GPU when the tokens are few (512 x 896 x 151936: the 16 programs of
# the old 128 x 256 tile walked the whole vocabulary, 1.36 ms on an H100; cuBLAS's split-K
# took 0.25 ms).
_DX_SEGMENTS = 16
# Most bytes of float32 partials the split form may hold (segments x N x H x 4).
_DX_SPLIT_BYTES = 256 << 20
# Elements per program of the split form's merge.
_MERGE_DX_BLOCK = 1024
# Weight rows a program of the gathered dot products reads ([16, 256] float32 products).
_DOT_ROWS = 16
# Tensor descriptors (Hopper's bulk copy engine) instead of pointer loads, where the tiles allow:
# forward 32.9 ms vs 37.1, logit-gradient kernel 33.3 ms vs 38.8 at 16384 x 4096 x 151936.
_USE_TMA = True
# Multiply-adds of a product (N x V x H) below which its operands are loaded by pointers. The
# descriptors cost the host: a pair costs 30-40 us a launch (their making, 10-19 us, and the
# launcher's encoding of them: 37-49 us against 13-23 for the kernels without;
# benchmarks/results/profile_calls_h200.log). They save such a kernel 3-6% of its GPU time, which counts
# only where the GPU, not the host, bounds the call. H200, 2^34 against 2^37 in one process
# (benchmarks/results/profile_calls_h200.log, profile_calls.py --tma-threshold):
#   - at 2^35 multiply-adds (256 x 4096 and 512 x 2048 x 32000), pointers took less host time in
#     all 8 (shape, path) pairs: 0.05-0.22 ms a call of 0.94-1.74, and the wall fell 4-22%;
#   - at 3.9 x 2^34 the host fell in 7 of 8 pairs and the wall in 6 (policy into main_grad 5-7%
#     slower);
#   - from 4.6 x 2^34 up the descriptors' wall led in 17 of 20 pairs.
# 2^36 lies between 3.9 and 4.6 x 2^34 (no work between them measured).
# The choice follows the number of tokens, so batch invariance rests on both loads giving the
# same bits, as the fallback for misaligned operands always did
# (test_tensor_descriptor_loads_match_pointer_loads; and
# test_a_tokens_statistics_do_not_depend_on_the_call, whose 7-token and 3000-token calls fall
# on either side of a lowered threshold on GPU).
_TMA_MIN_WORK = 1 << 36


if triton is not None:  # the kernels live apart: launches here, arithmetic there
    from . import triton_kernels as _tk
    from .launch import FastLaunch
    from .triton_losses import _logits_kernel

    # launched with less of the host's work a launch (launch.py)
    _dlogits_kernel = FastLaunch(_tk._dlogits_kernel)
    _gathered_dots_kernel = FastLaunch(_tk._gathered_dots_kernel)
    _given_dlogits_kernel = FastLaunch(_tk._given_dlogits_kernel)
    _hidden_grad_kernel = FastLaunch(_tk._hidden_grad_kernel)
    _merge_final_kernel = FastLaunch(_tk._merge_final_kernel)
    _merge_partials_kernel = FastLaunch(_tk._merge_partials_kernel)
    _merge_segments_kernel = FastLaunch(_tk._merge_segments_kernel)
    _stats_fwd_kernel = FastLaunch(_tk._stats_fwd_kernel)
    _write_columns_kernel = FastLaunch(_tk._write_columns_kernel)
    _logits_kernel = FastLaunch(_logits_kernel)


def dx_segment(v: int) -> int:
    """Columns of each of the hidden gradient's :data:`_DX_SEGMENTS` vocabulary segments (the
    last may be shorter): a multiple of 256, from the vocabulary's size alone."""
    return max(256, math.ceil(v / _DX_SEGMENTS / 256) * 256)


def vocab_segments(vtiles: int) -> tuple[int, int]:
    """(tiles per segment, segments) of a vocabulary of ``vtiles`` tiles: about
    :data:`_SEGMENTS`, every one starting at a tile with a real column."""
    seg_tiles = math.ceil(vtiles / min(vtiles, _SEGMENTS))
    return seg_tiles, math.ceil(vtiles / seg_tiles)


@functools.lru_cache(maxsize=256)  # a few ints a call, the same ones call after call (host time)
def forward_splits(row_blocks: int, vtiles: int, sms: int, min_splits: int = _MIN_SPLITS) -> int:
    """Vocab splits of the statistics kernel's grid (``row_blocks x splits`` programs, one per SM
    at a time, each walking ``vtiles / splits`` vocab units: the kernel's segments), at least
    ``min_splits`` (:data:`_MIN_SPLITS`).

    Where a group's programs fit on the GPU at once (``row_blocks x splits <= sms``): the fewest
    splits within 2% of the least units per program among those that fit. More waves of
    shorter programs were slower, though the old cost (waves x units) ranked them first: at
    2048 x 4096 x 151936 on an H200, 198 segments in 33 splits (4 waves) took 4.27 ms, where 32
    segments in 8 splits took 3.93 in the same run, and 198 in 8 splits 3.93-3.95 in two others
    (``benchmarks/results/profile_kernels_h200.log``: its --segments run and the split rule's
    probe). Likely, not measured: each wave re-reads the weight for its row blocks, where one
    wave reads it once for the group. Where none fits (more than ``sms / min_splits`` row
    blocks): waves x units per program, the fewest splits within 2% of the least (a rule of
    two programs per SM had left a last wave of a few programs: 4096 x 4096 x 151936 took 9.38
    ms with it, 7.75 with this; ``--splits``)."""
    top = max(min_splits, 2 * math.ceil(2 * sms / row_blocks))
    candidates = range(min(min_splits, vtiles), min(top, vtiles) + 1)

    def per_program(s: int) -> int:
        return math.ceil(vtiles / s)  # as the launch rounds it: splits may shrink

    def launched(s: int) -> int:
        return math.ceil(vtiles / per_program(s))

    one_wave = [s for s in candidates if row_blocks * launched(s) <= sms]
    if one_wave:
        least = min(per_program(s) for s in one_wave)
        return next(s for s in one_wave if per_program(s) <= least * 1.02)

    def cost(s: int) -> int:
        return math.ceil(row_blocks * launched(s) / sms) * per_program(s)

    least = min(cost(s) for s in candidates)
    return next(s for s in candidates if cost(s) <= least * 1.02)


def _operands_contiguous(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels index rows by one stride and columns by 1: contiguous tensors (free where
    they are already)."""
    return tuple(t.contiguous() for t in ts)


def _descriptors(a: torch.Tensor, a_box: list[int], b: torch.Tensor, b_box: list[int],
                 tma: bool, work: int) -> tuple[Any, Any, bool]:
    """Tensor descriptors of ``a`` and ``b`` (boxes of these shapes) for the copy engine where it
    can be used and the product (``work`` multiply-adds) is worth their host time
    (:data:`_TMA_MIN_WORK`), else the tensors themselves."""
    # The copy engine needs 16-byte aligned base addresses and row strides (a view's rows may
    # be longer than its columns: a chunk of a wider buffer).
    use = (
        tma
        and _USE_TMA
        and work >= _TMA_MIN_WORK
        and TensorDescriptor is not None
        and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
                and t.data_ptr() % 16 == 0 for t in (a, b))
    )
    if not use:
        return a, b, False
    return TensorDescriptor.from_tensor(a, a_box), TensorDescriptor.from_tensor(b, b_box), True


def _operands(x: torch.Tensor, weight: torch.Tensor, tile: Tile, tma: bool) -> tuple[Any, Any, bool]:
    """``x @ W.T``'s operands: both in boxes of ``block_k`` of the hidden size."""
    return _descriptors(x, [tile.block_n, tile.block_k], weight, [tile.block_v, tile.block_k], tma,
                        x.shape[0] * weight.shape[0] * x.shape[1])


def _product_operands(dz: torch.Tensor, weight: torch.Tensor, tile: Tile, tma: bool) -> tuple[Any, Any, bool]:
    """``dz @ W``'s operands: ``W`` in boxes of ``block_k`` of its rows (the sum's)."""
    return _descriptors(dz, [tile.block_n, tile.block_k], weight, [tile.block_k, tile.block_v], tma,
                        dz.shape[0] * dz.shape[1] * weight.shape[1])


class TritonFused(TritonRows, Backend):
    """The Triton backend with one GPU family's :class:`Tiles`."""

    name = "triton"
    # Losses with gradients in the forward: bytes of one token chunk's logit gradient plus half
    # a chunk of fp32 logits. Larger chunks mean fewer passes of cuBLAS over the fp32 dW accumulator (V x H x 8
    # bytes each): at 16384 x 4096 x 151936 on an H200, dW runs at 91% of the matmul ceiling with
    # 4096-token chunks, 85% with 2048 (benchmarks/results/profile_kernels_h200.log).
    fused_chunk_bytes = 5 << 29
    # Where dW goes into an accumulator in the forward (a declared upstream gradient) no float32
    # [V, H] buffer is held and the chunk is most of the memory: 1.5 GiB, 2560-token chunks at
    # 16384 x 4096 x 151936 (H200, GRPO: 105.9 ms / 1740 MiB; 106.3 / 1444 at 2048 tokens;
    # 100.2 / 2631 at 4096 in another run; benchmarks/RESULTS.md).
    accumulating_chunk_bytes = 3 << 29

    # A fused loss forms its gradients in the forward from this hidden size on (6NHV, a chunk's
    # logits and their gradient made once); below it, in the backward from the statistics pass
    # (8NHV, the logits recomputed; loss_op.forms_gradients_in_forward). 0: the forward at every
    # hidden size. It was 2048 until the forward route took its whole chunk in one launch and
    # its few-token dW from the kept logit gradient; then the forward led at every hidden size
    # measured, 896-1536 x 256-32768 tokens x 32000 / 151936, and the backward's 19 launches made
    # calls of 256-512 tokens 1.1-1.5x stock's (H200: benchmarks/RESULTS.md, bench_sweep.py
    # --route). Kept a class attribute: --route and the tests take the backward route by it.
    forward_gradients_min_hidden = 0

    def __init__(self, tiles: Tiles = TILES[0]) -> None:
        self.tiles = tiles

    def logits_rows(self, c, n, chunk_size, v_local, itemsize, into):
        # The whole chunk where its logits and their gradient fit the budget: each launch of the
        # logits kernel reads all of W, so two half chunks read it twice (256 x 4096 x 151936,
        # H200: 0.74 ms for the two halves, 0.50 at once; stock's cuBLAS logits 0.41). The
        # chunk size alone cannot say so: a call of one chunk is sized to its own tokens.
        if c * v_local * (itemsize + 4) <= self.chunk_bytes(into):
            return c
        return super().logits_rows(c, n, chunk_size, v_local, itemsize, into)

    def local_stats(self, x, weight, coef, local_label, chunk_size) -> LocalStats:
        x, weight, coef, local_label = _operands_contiguous(x, weight, coef, local_label)
        parts = self._segment_stats(x, weight, coef)
        n = x.shape[0]
        stats = torch.empty((3, n), dtype=torch.float32, device=x.device)
        t = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:  # the label's logit formed in the merge
            _merge_segments_kernel[(cdiv(n, _MERGE_BLOCK),)](
                parts[0], parts[1], parts[2], x, weight, coef, local_label, stats[0], stats[1],
                stats[2], t, n, parts.shape[1], x.shape[1], x.stride(0), weight.stride(0),
                BLOCK=_MERGE_BLOCK, BLOCK_H=_LABEL_BLOCK_H, num_warps=4)
        return LocalStats(stats[0], stats[1], stats[2], t)

    def _segment_stats(self, x, weight, coef, coef_scalar=None) -> torch.Tensor:
        """``[3, segments, N]`` float32 statistics of each vocabulary segment: the statistics
        kernel, one launch (contiguous operands); ``coef_scalar``: every token's coefficient,
        instead of the ``coef`` tensor (None)."""
        n, h = x.shape
        v = weight.shape[0]
        tile = self.tiles.fwd
        seg_tiles, segments = vocab_segments(cdiv(v, tile.block_v))
        parts = torch.empty((3, segments, n), dtype=torch.float32, device=x.device)
        if n == 0:
            return parts
        sms = _num_sms(x.device.index or 0)
        # One launch, its programs in groups of _FWD_GROUP tokens: a group's programs fill the
        # GPU about once and walk the weight together, and groups follow one another. (A launch
        # over all the tokens with no groups took 185-236 ms at 65536 x 4096 x 151936 on an
        # H100, against 132 ms with a launch per group: benchmarks/RESULTS.md.)
        row_blocks = cdiv(n, tile.block_n)
        group = min(row_blocks, _FWD_GROUP // tile.block_n)
        want = forward_splits(group, segments, sms, _MIN_SPLITS)  # the global read here: benchmarks vary it
        segs_per_split = cdiv(segments, min(segments, want))
        splits = cdiv(segments, segs_per_split)
        xa, wa, tma = _operands(x, weight, tile, self.tiles.tma)
        scalar = coef_scalar is not None
        _stats_fwd_kernel[(row_blocks * splits,)](
            xa, wa, parts if scalar else coef, parts[0], parts[1], parts[2], n, v, h, x.stride(0),
            weight.stride(0), n, seg_tiles, segments, segs_per_split, splits, group,
            coef_scalar if scalar else 0.0,
            EVEN_K=h % tile.block_k == 0, USE_TMA=tma, SCALAR_COEF=scalar, **tile.launch(),
        )
        return parts

    def stats(self, x, weight, coef, local_label, valid, chunk_size, group, ordered):
        if group is not None:  # the shards' statistics combined over the group: in torch
            return super().stats(x, weight, coef, local_label, valid, chunk_size, group, ordered)
        x, weight, coef, local_label = _operands_contiguous(x, weight, coef, local_label)
        return self._finished(x, weight, self._segment_stats(x, weight, coef), coef, local_label,
                              valid)

    def stats_with_prologue(self, x, weight, labels, prologue):
        """:meth:`stats` on one rank with the prologue's work folded into its launches, for a
        scalar coefficient: ``prologue`` is ``(coef, ignore_index, v_total, vocab_start,
        v_local)`` (:attr:`~..common.options.KernelParams.prologue`), ``labels`` the global ids. The
        statistics kernel takes the coefficient as a scalar and the merge forms each token's
        validity, coefficient and local row as the prologue's kernel does (a launch less).
        Returns :meth:`stats`'s six and ``(valid, coef, local labels)``."""
        coef_scalar = prologue[0]
        x, weight, labels = _operands_contiguous(x, weight, labels)
        n = x.shape[0]
        valid = torch.empty(n, dtype=torch.bool, device=x.device)
        coef = torch.empty(n, dtype=torch.float32, device=x.device)
        local = torch.empty(n, dtype=torch.long, device=x.device)
        out = self._finished(x, weight, self._segment_stats(x, weight, None, coef_scalar), coef,
                             local, valid, labels, prologue)
        return out + (valid, coef, local)

    def _finished(self, x, weight, parts, coef, local_label, valid, labels=None, prologue=None):
        """One rank's statistics from the segments' (:meth:`stats`), in one launch; with
        ``prologue``, ``coef``, ``local_label`` and ``valid`` are written, from ``labels``."""
        n = x.shape[0]
        # apart, not rows of one buffer: they are the op's outputs, which may not alias
        out = [torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(5)]
        best = torch.empty(n, dtype=torch.bool, device=x.device)
        if n:  # one rank: the merge finishes them (as Backend.stats would, in one launch)
            folded = prologue is not None
            consts = prologue if folded else (0.0, 0, 0, 0, 0)
            _merge_final_kernel[(cdiv(n, _MERGE_BLOCK),)](
                parts[0], parts[1], parts[2], x, weight, coef, local_label, valid, out[0], out[1],
                out[2], best, out[3], out[4], n, parts.shape[1], x.shape[1], x.stride(0),
                weight.stride(0), labels if folded else local_label, consts[1], consts[2],
                consts[3], consts[4], consts[0], BLOCK=_MERGE_BLOCK, BLOCK_H=_LABEL_BLOCK_H,
                PRECISE=os.environ.get("TRITON_INTERPRET") != "1", PROLOGUE=folded, num_warps=4)
        return out[0], out[1], out[2], best, out[3], out[4]

    @staticmethod
    def gathered_dots(x, weight, rows):
        n, k = rows.shape
        out = torch.empty((n, k), dtype=torch.float32, device=x.device)
        if n and k:
            x, weight = x.contiguous(), weight.contiguous()
            _gathered_dots_kernel[(n, cdiv(k, _DOT_ROWS))](
                x, weight, rows.contiguous(), out, k, x.shape[1], x.stride(0), weight.stride(0),
                BLOCK_K=_DOT_ROWS, BLOCK_H=256, num_warps=4)
        return out

    def grads(self, x, weight, coef, local_label, m, log_s, entropy, g1, g2, valid, chunk_size, need_x,
              need_w, dw_accumulator=None, extra=None):
        n, h = x.shape
        v = weight.shape[0]
        tile = self.tiles.bwd
        bv = tile.block_v
        x, weight = x.contiguous(), weight.contiguous()
        # Chunks of whole dX segments, so dX's sum over the vocabulary has one shape however
        # many chunks there are (a chunk of one segment may pass the budget: at V 151936, from
        # 55000 tokens on).
        seg = dx_segment(v)
        vc = min(cdiv(v, seg), max(1, _BWD_CHUNK_BYTES // (max(n, 1) * x.element_size() * seg))) * seg
        chunks = cdiv(v, vc)
        dz = torch.empty((n, vc), dtype=x.dtype, device=x.device)
        dx = torch.empty((n, h), dtype=x.dtype, device=x.device) if need_x else None
        dx32 = torch.empty((n, h), dtype=torch.float32, device=x.device) if need_x and chunks > 1 else None
        dw = torch.empty_like(weight) if need_w and dw_accumulator is None else None
        row_blocks = cdiv(n, tile.block_n)
        xa, wa, tma = _operands(x, weight, tile, self.tiles.tma)
        # the upstream gradients as they come (any stride; None: that output was not used),
        # masked by validity in the kernels (no where, nor zeros, launched first)
        ups = (g1 if g1 is not None else m, g2 if g2 is not None else m)
        valid = valid.contiguous()
        strides = (0 if g1 is None else g1.stride(0), 0 if g2 is None else g2.stride(0))
        has = dict(HAS_G1=g1 is not None, HAS_G2=g2 is not None)
        given = None
        if extra is not None:
            e_cols = extra[0].contiguous()
            k = e_cols.shape[1]
            given = torch.empty(e_cols.shape, dtype=x.dtype, device=x.device)
            grid = (cdiv(n, _GIVEN_ROWS), cdiv(k, _GIVEN_COLS))
            _given_dlogits_kernel[grid](e_cols, extra[1].float().contiguous(), extra[2].contiguous(),
                                        coef, local_label, valid, m, log_s, entropy, ups[0], ups[1],
                                        given, n, k, *strides, BLOCK_N=_GIVEN_ROWS,
                                        BLOCK_K=_GIVEN_COLS, **has)
        for i in range(chunks):
            v0 = i * vc
            width = min(vc, v - v0)
            cols = slice(v0, v0 + width)
            chunk = dz if width == vc else dz[:, :width]
            _dlogits_kernel[(cdiv(width, bv) * row_blocks,)](
                xa, wa, coef, local_label, valid, m, log_s, entropy, ups[0], ups[1], dz,
                n, v, h, v0, width, x.stride(0), weight.stride(0), dz.stride(0), *strides,
                EVEN_K=h % tile.block_k == 0, USE_TMA=tma, GROUP=_DZ_GROUP, **tile.launch(), **has,
            )
            if given is not None:
                _write_columns_kernel[grid](dz, e_cols, given, n, k, v0, width, dz.stride(0),
                                            BLOCK_N=_GIVEN_ROWS, BLOCK_K=_GIVEN_COLS)
            if dw is not None:
                torch.mm(chunk.t(), x, out=rows_of(dw, cols))  # K = N: rounded once
            elif need_w:  # Megatron's main_grad: fp32 accumulation, as its wgrad GEMM does
                addmm_f32_(rows_of(dw_accumulator, cols), chunk.t(), x)
            if need_x:  # float32 between chunks, the input dtype after the last
                self._hidden_grad(chunk, rows_of(weight, cols), seg, dx32 if i > 0 else None,
                                  dx if i == chunks - 1 else dx32)
        return dx, dw

    def logits(self, x, weight, out):
        n, h = x.shape
        v = weight.shape[0]
        if n == 0:
            return out
        tile = self.tiles.fwd
        x, weight = x.contiguous(), weight.contiguous()
        xa, wa, tma = _operands(x, weight, tile, self.tiles.tma)
        grid = (cdiv(n, tile.block_n) * cdiv(v, tile.block_v),)
        _logits_kernel[grid](xa, wa, out, n, v, h, x.stride(0), weight.stride(0), out.stride(0),
                             EVEN_K=h % tile.block_k == 0, USE_TMA=tma, **tile.launch())
        return out

    def hidden_grad(self, dz, weight, out):
        return self._hidden_grad(dz, weight, dx_segment(weight.shape[0]), None, out)

    def _hidden_grad(self, dz, weight, seg, acc, out):
        """``out = acc + dz @ weight`` over whole segments of ``seg`` columns (``acc`` float32
        or None for 0; ``out`` contiguous float32, or the input dtype, rounded once), the
        vocabulary's sum in one shape (see the kernel), split over more programs where the
        tiles alone would not fill the GPU."""
        n, v = dz.shape
        h = weight.shape[1]
        if n == 0:
            return out
        tile = self.tiles.dx
        weight = weight.contiguous()
        if dz.stride(1) != 1:
            dz = dz.contiguous()
        a, b, tma = _product_operands(dz, weight, tile, self.tiles.tma)
        segments = cdiv(v, seg)
        tiles = cdiv(n, tile.block_n) * cdiv(h, tile.block_v)
        split = (segments > 1 and tiles < 2 * _num_sms(dz.device.index or 0)
                 and segments * n * h * 4 <= _DX_SPLIT_BYTES)
        cont = acc is not None
        common = dict(USE_TMA=tma, GROUP=_DX_GROUP, CONTINUE=cont, **tile.launch())
        if not split:
            _hidden_grad_kernel[(tiles,)](a, b, acc if cont else out, out, out, n, h, v, seg, segments,
                                          dz.stride(0), weight.stride(0), out.stride(0),
                                          SPLIT=False, **common)
            return out
        parts = torch.empty((segments, n, h), dtype=torch.float32, device=dz.device)
        _hidden_grad_kernel[(tiles * segments,)](a, b, parts, parts, parts, n, h, v, seg, segments,
                                                 dz.stride(0), weight.stride(0), h, SPLIT=True, **common)
        _merge_partials_kernel[(cdiv(n * h, _MERGE_DX_BLOCK),)](
            parts, acc if cont else out, out, n * h, segments, BLOCK=_MERGE_DX_BLOCK, CONTINUE=cont,
            num_warps=4)
        return out
