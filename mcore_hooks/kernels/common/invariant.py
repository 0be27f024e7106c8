"""Batch invariance (the default, ``batch_invariant=True``): a backend run on fixed-shape token blocks.

A GEMM library picks its algorithm (tiles, split-K) by shape, so the same token's logits can be
summed in another order when the call holds more or fewer tokens (up to 1.9e-6 in a log-prob,
measured on an H200 between 7 and 16384 tokens, before the Triton backend's kernels made its
own paths invariant). The Triton backend's passes sum each token in one order by construction
(dX's too: a fixed shape of vocabulary segments, ``triton_kernels._hidden_grad_kernel``) and run
as they are; what else goes through a BLAS does not: the torch backend's passes, and on
either backend the dense products of wide id sets and the truncation's top-k statistics
(:mod:`..passes.candidates`, ``candidates_op.top_k_ids``). :class:`InvariantBlocks` gives those the same
shapes whatever the call: the tokens are cut into blocks of :func:`block_rows` (2048 on a GPU,
64 on the CPU), each copied into a
fresh ``[block, H]`` buffer (the last padded with zero rows that count for nothing: label none,
no gradient), and the backend runs on each. Within a block no row's arithmetic depends on
another's (a GEMM's rows, the kernels' per-row statistics), so a token's results and its row of
dX are bitwise independent of which other tokens are in the call, of their number and of the
chunking (for a given ``chunk_size``: the default depends on the vocabulary only). Under tensor
parallelism the statistics' and dX's sums over the ranks run over all the call's tokens: a sum
of two terms has one order, but a collective's order over more ranks depends on the message
size and the element's place in it, so past two ranks each rank is brought its slice of
every rank's terms (an all-to-all) and adds them in rank order (``comm.all_reduce``'s
``ordered``). dW (the torch backend): each block's products are added into one float32 buffer in
block order, rounded once at the end; with Megatron's ``main_grad`` as that buffer, a call split
at block boundaries into micro-batches adds the same bits as the whole call.

``batch_invariant=False`` opts out: the torch backend then runs on the call's own shapes (faster
for a call much smaller than a block), and sums over more than two ranks are left to the
collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .autograd import Backend, FusedLoss, LocalStats
from .guards import adding_into

# Tokens per block on a GPU: one block's GEMMs run near peak (an H100/H200).
BLOCK = 2048
# On the CPU: a small call (a test, a debugging session) pays for at most 63 padding rows, not
# 2047 (the CPU test suite took 1.5% longer with these blocks on: benchmarks/RESULTS.md).
CPU_BLOCK = 64


def block_rows(device: torch.device) -> int:
    """Tokens per fixed-shape block on ``device`` (a constant of the device type: never of the
    call)."""
    return BLOCK if device.type == "cuda" else CPU_BLOCK


def tiling_chunk(chunk_size: int, block: int) -> int:
    """The rows of every logits product on a block: the largest power of two at most half of
    ``chunk_size`` (at least 1, at most the block, which it divides). Every chunk of every block
    then has one shape, in every pass: the statistics and the backward take chunks of it, the
    fused loss chunks of twice it, whose logits it forms in halves (``Backend.fused_loss``).
    Products of other row counts (a short last chunk's 1-3 rows) round differently on some CPU
    BLAS: a token's bits would follow its place in the call, or the pass (the no-grad forward of
    a checkpointed region against its recomputation)."""
    c = min(max(1, chunk_size // 2), block)
    return 1 << (c.bit_length() - 1)


def padded(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """``t``'s rows, then ``fill`` up to ``rows``, in a fresh contiguous tensor."""
    out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out


def blocks(n: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, n)) for s in range(0, n, block)]


class _BlockLoss:
    """A :class:`~.autograd.TokenLoss` seen from one padded block: rows of the block are rows
    ``start + r`` of the call, the padding's terms are 0."""

    def __init__(self, inner, start: int, end: int) -> None:
        self.inner, self.start, self.end = inner, start, end
        self.needs_entropy = inner.needs_entropy

    def terms(self, rows: slice, logprob: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
        a = self.start + rows.start
        real = max(0, min(self.start + rows.stop, self.end) - a)
        head = self.inner.terms(slice(a, a + real), logprob[:real],
                                None if entropy is None else entropy[:real])
        return torch.cat([head, logprob[real:] * 0.0])  # the padding: 0, no gradient


class InvariantBlocks(Backend):
    """``inner`` run on fixed-shape blocks of ``block`` tokens (module docstring)."""

    def __init__(self, inner: Backend, block: int) -> None:
        self.inner, self.block = inner, block
        self.name = inner.name
        self.fused_chunk_bytes = inner.fused_chunk_bytes
        self.accumulating_chunk_bytes = inner.accumulating_chunk_bytes

    def local_stats(self, x, weight, coef, local_label, chunk_size, floor=None) -> LocalStats:
        b, parts = self.block, []
        for s, e in blocks(x.shape[0], b):
            fl = {} if floor is None else {"floor": padded(floor[s:e], b, 0.0)}
            st = self.inner.local_stats(padded(x[s:e], b, 0), weight, padded(coef[s:e], b, 1.0),
                                        padded(local_label[s:e], b, -1), tiling_chunk(chunk_size, b), **fl)
            parts.append([t[: e - s] for t in st])
        return LocalStats(*(torch.cat(ts) for ts in zip(*parts)))

    def stats(self, x, weight, coef, local_label, valid, chunk_size, group, ordered, floor=None):
        # the generic finish over this backend's blocked local_stats (never the inner's own)
        return Backend.stats(self, x, weight, coef, local_label, valid, chunk_size, group, ordered, floor)

    def each_chunk(self, x, weight, coef, chunk_size, fn) -> None:
        """The inner backend's ``each_chunk`` on each padded block (the padding's rows not
        passed to ``fn``)."""
        b = self.block
        for s, e in blocks(x.shape[0], b):
            def on_block(s0, s1, z, s=s, e=e):
                if s0 < e - s:
                    fn(s + s0, s + min(s1, e - s), z[: min(s1, e - s) - s0])

            self.inner.each_chunk(padded(x[s:e], b, 0), weight, padded(coef[s:e], b, 1.0),
                                  tiling_chunk(chunk_size, b), on_block)

    def gathered_dots(self, x, weight, rows):
        return self.inner.gathered_dots(x, weight, rows)  # per token already: invariant

    def grads(self, x, weight, coef, local_label, m, log_s, entropy, g1, g2, valid, chunk_size, need_x,
              need_w, dw_accumulator=None, extra=None, floor=None):
        b = self.block
        acc = dw_accumulator
        if need_w and acc is None:  # the blocks' products summed in float32, rounded once
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if need_x else None
        for s, e in blocks(x.shape[0], b):
            # the upstream gradients as they came (None stays None): the inner backend masks them
            pad = [None if t is None else padded(t[s:e], b, 0.0) for t in (m, log_s, entropy, g1, g2)]
            ext = None if extra is None else tuple(
                padded(t[s:e], b, fill) for t, fill in zip(extra, (-1, 0.0, 0.0)))
            dxb, _ = self.inner.grads(padded(x[s:e], b, 0), weight, padded(coef[s:e], b, 1.0),
                                      padded(local_label[s:e], b, -1), *pad, padded(valid[s:e], b, False),
                                      tiling_chunk(chunk_size, b), need_x, need_w,
                                      acc if need_w else None, ext,
                                      **({} if floor is None else {"floor": padded(floor[s:e], b, 0.0)}))
            if need_x:
                dx[s:e] = dxb[: e - s]
        if not need_w or dw_accumulator is not None:
            return dx, None
        return dx, acc.to(weight.dtype)

    def fused_loss(self, x, weight, p, local_label, token_loss, need_x, need_w,
                   dw_sum: Optional[torch.Tensor] = None, defer_weight_grad: bool = False) -> FusedLoss:
        if defer_weight_grad:
            raise ValueError("defer_weight_grad: not on fixed-shape blocks")
        b, n = self.block, x.shape[0]
        into = p.weight_grad_accumulator is not None and p.upstream_grad is not None
        total = None
        if need_w and not into:
            total = dw_sum if dw_sum is not None else torch.zeros(weight.shape, dtype=torch.float32,
                                                                  device=x.device)
        outs = []
        # one scope for the blocks: a block that fails after others added spoils the accumulator
        with adding_into(p.weight_grad_accumulator if into and need_w else None):
            for s, e in blocks(n, b):
                q = dataclasses.replace(p, labels=padded(p.labels[s:e], b, -1),
                                        valid=padded(p.valid[s:e], b, False), coef=padded(p.coef[s:e], b, 1.0),
                                        chunk_size=2 * tiling_chunk(p.chunk_size, b))
                r = self.inner.fused_loss(padded(x[s:e], b, 0), weight, q, padded(local_label[s:e], b, -1),
                                          _BlockLoss(token_loss, s, e), need_x, need_w, dw_sum=total)
                outs.append((r.loss[: e - s], r.logprob[: e - s],
                             None if r.entropy is None else r.entropy[: e - s],
                             None if r.dx is None else r.dx[: e - s]))
        loss, logprob, entropy, dx = (None if any(o[i] is None for o in outs) else torch.cat([o[i] for o in outs])
                                      for i in range(4))
        return FusedLoss(loss, logprob, entropy, dx, total)

    def row_stats(self, z, coef, local_label, with_entropy):
        return self.inner.row_stats(z, coef, local_label, with_entropy)

    def row_grad(self, z, coef, local_label, m, log_s, g1, g2, entropy, out):
        return self.inner.row_grad(z, coef, local_label, m, log_s, g1, g2, entropy, out)
