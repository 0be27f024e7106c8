"""What every backend shares: the statistics' algebra, the fused loss's chunk loop, the per-token
loss's derivatives (the guards of the passes' contracts are :mod:`.guards`).

A backend (:class:`Backend`) supplies the passes over this rank's vocabulary shard and owns their
chunk loops: ``local_stats`` / ``stats`` (forward: per-token max, sum-exp, entropy term and
target logit of the local logits; combined over the group), ``grads`` (backward: recompute the
logits, form their gradient, return dX and dW), and ``fused_loss`` (a loss whose gradients are
formed in the forward, over the row pass ``row_loss``). This module combines shards across the
tensor-parallel group (one all-gather of the shards' statistics per batch, or per chunk of the
fused loss, summed in rank order, through :mod:`.comm`, which also gathers sequence-parallel
hidden states and reduces their gradient), so the backends' kernels stay pure math. Options travel as one frozen
:class:`~.options.KernelParams`. The passes run as custom ops (:mod:`..passes.ops`); only a loss given
as a Python function runs through :class:`~..passes.loss_op.LinearFusedLoss`, outside the ops.

Per token, with ``l = coef * (x @ W.T)`` (``coef = logit_scale / temperature``) over the full
vocabulary, ``m = max l``, ``s = sum exp(l - m)``, ``logZ = m + log s``, ``p = exp(l - logZ)``:

* ``logprob = (l[y] - m) - log s``: ``m`` and ``log s`` stay apart, as in ``log_softmax``, because
  ``logZ`` rounded to float32 is off by half an ulp of the largest logit, which ``p`` would inherit;
* ``entropy = log s - sum(exp(l - m) * (l - m)) / s`` — each term is taken relative to the max,
  so it stays exact when all logits are hugely negative or hugely positive;
* ``d logprob / d l_j = 1[j = y] - p_j``; ``d entropy / d l_j = -p_j (log p_j + entropy)``.

A fused loss is ``sum_i f_i(logprob_i, entropy_i)`` (:class:`TokenLoss`): the
cross-entropy ``sum_i w_i (logZ_i - l_i[y_i])``, or a policy loss. Its upstream gradient is one
scalar, so the logit gradients ``f_i' `` are formed in the forward while each token chunk's logits
exist (3 matmuls, 6NHV, instead of recomputing them: 8NHV); the backward only scales dX and dW by
that scalar. The products are cuBLAS (:mod:`.matmul`) unless the backend has its own
(``logits``, ``hidden_grad``: the Triton backend's sum each row in one order).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Protocol

import torch

from .comm import gather_tokens, group_rank_size
from .guards import adding_into, check_not_recomputed, saved_tensor_hooks_active
from .matmul import addmm_f32_, mm_f32
from .options import KernelParams


class LocalStats(NamedTuple):
    """Float32 ``[N]`` statistics of this rank's logits: ``m_loc``, ``sum exp(l - m_loc)``,
    ``sum exp(l - m_loc) * (l - m_loc)`` (0 where not asked for) and the label's logit (0 where
    not owned)."""

    max: torch.Tensor
    sumexp: torch.Tensor
    plogp: torch.Tensor
    target: torch.Tensor


class TokenLoss(Protocol):
    """A loss ``sum_i f_i(logprob_i, entropy_i)``: each token's term depends only on its own
    log-prob and entropy (and on per-token data the loss holds), so its logit gradient can be
    formed while the token's logits exist. ``terms`` is called on consecutive token chunks
    (``rows``) with float32 values and returns each token's term, differentiable in them (its
    derivatives are taken by autograd)."""

    needs_entropy: bool

    def terms(
        self, rows: slice, logprob: torch.Tensor, entropy: Optional[torch.Tensor]
    ) -> torch.Tensor: ...


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")


def _autograd_reenabled():
    """Inside a custom op's implementation (:mod:`..passes.ops`) the dispatcher has excluded the autograd
    keys, so a ``torch.autograd.grad`` there would see no graph; re-include them for the block
    (restored on exit). Outside an op: nothing to do."""
    C = torch._C
    excluded = C._dispatch_tls_local_exclude_set()
    keys = [getattr(C.DispatchKey, k) for k in _AUTOGRAD_KEYS]
    if not any(excluded.has(k) for k in keys):
        return contextlib.nullcontext()
    for k in keys:
        excluded = excluded.remove(k)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), excluded)


def term_grads(
    token_loss: TokenLoss, rows: slice, logprob: torch.Tensor, entropy: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A chunk's terms (detached) and their derivatives in the log-prob and the entropy (None
    where the terms do not depend on the entropy)."""
    # The derivatives are taken here, inside the forward: saved-tensor hooks of an enclosing
    # region (a non-reentrant activation checkpoint packs every saved tensor, and unpacking one
    # re-runs the whole region) must not see this private graph, so pass-through hooks shield it
    # where any are active (pushing them elsewhere would fail where hooks are disabled).
    hooked = saved_tensor_hooks_active()
    shield = torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is) if hooked else contextlib.nullcontext()
    with _autograd_reenabled(), torch.enable_grad(), shield:
        lp = logprob.detach().requires_grad_()
        ent = entropy.detach().requires_grad_() if entropy is not None else None
        t = token_loss.terms(rows, lp, ent)
        wrt = [lp] if ent is None else [lp, ent]
        grads = torch.autograd.grad(t.sum(), wrt, allow_unused=True) if t.requires_grad else [None] * len(wrt)
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(logprob)
    g_ent = grads[1] if ent is not None else None
    return t.detach(), g_lp, g_ent


class FusedLoss(NamedTuple):
    """What :meth:`Backend.fused_loss` returns: float32 ``[N]`` per-token terms, log-probs and
    entropies (None when the loss did not ask for them), and the float32 dX ``[N, H]`` and dW
    ``[V_local, H]`` of the summed loss (None where not needed, or where the logit gradient
    ``dz`` is kept for the backward to form dW from)."""

    loss: torch.Tensor
    logprob: torch.Tensor
    entropy: Optional[torch.Tensor]
    dx: Optional[torch.Tensor]
    dw: Optional[torch.Tensor]
    dz: Optional[torch.Tensor] = None  # with defer_weight_grad: the logit gradient [N, V_local]


class Backend:
    """The passes a backend implements, and the chunk loop of the losses whose gradients are
    formed in the forward (written once, over the backend's row passes).

    * ``local_stats``: forward of the log-prob/entropy pass (its own chunk loop);
    * ``grads``: its backward, recomputing the logits (its own chunk loop);
    * ``row_stats`` / ``row_grad``: one chunk's materialised float32 logits ``z = x @ W.T``
      (``coef`` applied on load) to statistics, and to the logit gradient of a :class:`TokenLoss`.
    """

    name: str = "?"
    # fused_loss: bytes of one token chunk's logit gradient plus half a chunk of fp32 logits;
    # the second where dW goes into an accumulator in the forward (no [V, H] buffer is held,
    # so the chunk is most of the memory)
    fused_chunk_bytes: int = 1 << 28
    accumulating_chunk_bytes: int = 1 << 28

    @classmethod
    def chunk_bytes(cls, into: bool) -> int:
        """The fused losses' chunk budget: ``accumulating_chunk_bytes`` where dW goes into an
        accumulator in the forward (``into``), else ``fused_chunk_bytes``."""
        return cls.accumulating_chunk_bytes if into else cls.fused_chunk_bytes

    def local_stats(
        self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor,
        chunk_size: int,
    ) -> LocalStats:
        raise NotImplementedError

    def each_chunk(self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, chunk_size: int,
                   fn) -> None:
        """``fn(start, end, z)`` on each chunk's float32 scaled logits ``z``, made as
        ``grads`` makes them (the torch backend's: a truncation's floor, :mod:`..kept_sets.nucleus`)."""
        raise NotImplementedError

    def logits_rows(self, c: int, n: int, chunk_size: int, v_local: int, itemsize: int,
                    into: bool) -> int:
        """Tokens of float32 logits :meth:`fused_loss` makes at a time in a chunk of ``c`` (of a
        call of ``n``, chunks of ``chunk_size``; ``into``: dW goes into an accumulator): the
        whole chunk where the call is at most half a chunk, else half (the chunk is sized for
        that; fixed-shape blocks set their tiling so, :mod:`.invariant`)."""
        return c if 2 * n <= chunk_size else -(-c // 2)

    def stats(
        self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor,
        valid: torch.Tensor, chunk_size: int, group, ordered: bool, floor: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, ...]:
        """The log-prob/entropy pass's results, float32 ``[N]``: ``(logprob, entropy, logZ,
        label_is_argmax, max, log_s)``, the first two 0 where not ``valid``; ``local_stats``
        combined over ``group`` (:func:`combine`). ``floor``: over each token's
        kept set (the torch backend's, :mod:`..kept_sets.nucleus`)."""
        fl = {} if floor is None else {"floor": floor}
        st = combine(self.local_stats(x, weight, coef, local_label, chunk_size, **fl), group, ordered)
        return (torch.where(valid, st.logprob(), 0.0), torch.where(valid, st.entropy, 0.0),
                st.max + st.log_s, valid & label_is_row_max(st), st.max, st.log_s)

    def gathered_dots(
        self, x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Float32 ``[N, K]`` ``x_i . W[rows_ik]`` (``rows`` valid row indices), each dot's
        reduction order fixed by the backend alone; None where the backend has no kernel for
        it (the caller gathers the rows and multiplies them in torch)."""
        return None

    def grads(
        self, x: torch.Tensor, weight: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor,
        m: torch.Tensor, log_s: torch.Tensor, entropy: torch.Tensor,
        g_logprob: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor], valid: torch.Tensor,
        chunk_size: int, need_x: bool, need_w: bool,
        dw_accumulator: Optional[torch.Tensor] = None,
        extra: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """dX, and dW (or None with ``dw_accumulator``, a float32 tensor dW is added into).
        ``g_logprob`` / ``g_entropy``: the upstream gradients of log-prob and entropy, float32
        ``[N]`` of any stride (None: that output was not used), read only where ``valid``: an
        ignored token's may hold anything, NaN included (:func:`upstream_grads`).
        ``extra``: ``(columns [N, K], g [N, K], logits [N, K])``, more terms of the logit
        gradient, ``g`` added at each column of this shard (-1: none), as the label's
        ``g_logprob`` is: the gradient of given ids' logits (``selected_ids``), folded into the
        same products. ``logits`` are the forward's float32 ``coef * x . W[id]`` of the ids."""
        raise NotImplementedError

    def row_stats(
        self, z: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor, with_entropy: bool
    ) -> LocalStats:
        raise NotImplementedError

    # The fused losses' two products whose sums are a token's own (over H, over the
    # vocabulary): a backend whose kernels sum each row in one order whatever the number of
    # rows (batch invariance) overrides them; cuBLAS does not promise it.
    def logits(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = x @ weight.T`` into float32 ``out``."""
        return mm_f32(x, weight.t(), out=out)

    def hidden_grad(self, dz: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = dz @ weight`` into float32 ``out`` (dX, summed over the vocabulary)."""
        return mm_f32(dz, weight, out=out)

    def row_grad(
        self, z: torch.Tensor, coef: torch.Tensor, local_label: torch.Tensor, m: torch.Tensor,
        log_s: torch.Tensor, g_logprob: torch.Tensor, g_entropy: Optional[torch.Tensor],
        entropy: Optional[torch.Tensor], out: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``coef * dL/dl`` for ``L = sum g_logprob * logprob + g_entropy * entropy`` into
        ``out`` (input dtype), rows of ``z``."""
        raise NotImplementedError

    def row_loss(
        self, z: torch.Tensor, p: KernelParams, rows: slice, local_label: torch.Tensor,
        token_loss: TokenLoss, dz: Optional[torch.Tensor], loss: torch.Tensor,
        logprob: torch.Tensor, entropy: Optional[torch.Tensor],
    ) -> None:
        """One chunk of a fused loss: the rows ``rows`` of the call, their float32 logits ``z``.
        Writes their terms (0 where ignored), log-probs and entropies (0 where ignored; where
        ``entropy`` is not None) into ``loss``, ``logprob``, ``entropy``, and with ``dz`` the
        terms' logit gradient into it. Here the generic way: statistics (``row_stats``, combined
        over the group), the terms and their derivatives by autograd, then ``row_grad``; a
        backend may evaluate a loss given as data (``token_loss.kernel_data``) in its own kernel."""
        coef, valid = rows_of(p.coef, rows), rows_of(p.valid, rows)
        with_entropy = entropy is not None
        st = combine(self.row_stats(z, coef, local_label, with_entropy), p.group, p.batch_invariant)
        lp = torch.where(valid, st.logprob(), 0.0)
        ent = torch.where(valid, st.entropy, 0.0) if with_entropy else None
        terms, d_lp, d_ent = term_grads(token_loss, rows, lp, ent)
        # ignored positions: no term, no gradient (where, not a product: NaN-proof)
        loss.copy_(torch.where(valid, terms, 0.0))
        logprob.copy_(lp)
        if entropy is not None:
            entropy.copy_(ent)
        if dz is not None:
            g1 = torch.where(valid, d_lp, 0.0)
            g2 = None if d_ent is None else torch.where(valid, d_ent, 0.0)
            self.row_grad(z, coef, local_label, st.max, st.log_s, g1, g2,
                          st.entropy if g2 is not None else None, dz)

    def fused_loss(
        self, x: torch.Tensor, weight: torch.Tensor, p: KernelParams, local_label: torch.Tensor,
        token_loss: TokenLoss, need_x: bool, need_w: bool, dw_sum: Optional[torch.Tensor] = None,
        defer_weight_grad: bool = False,
    ) -> FusedLoss:
        """``sum_i f_i`` of a :class:`TokenLoss` and its gradients, in token chunks: each chunk's
        fp32 logits are made (``logits``; half a chunk at a time where a whole one would pass the
        budget), turned into statistics, terms and their logit gradient (``row_loss``); then dX
        (``hidden_grad``) and dW (cuBLAS: a sum over tokens) take the chunk's gradient (3
        matmuls in all, 6NHV). ``dw_sum``: a float32 buffer dW is added into (and returned)
        instead of a new one. ``defer_weight_grad`` (one chunk, dW returned, not added into an
        accumulator): no dW here; the logit gradient comes back as ``dz`` instead."""
        n, v_local = x.shape[0], weight.shape[0]
        weight = weight.contiguous()  # once, not in each chunk's products
        f32 = dict(dtype=torch.float32, device=x.device)
        # every row of these is written by row_loss
        loss, logprob = torch.empty(n, **f32), torch.empty(n, **f32)
        entropy = torch.empty(n, **f32) if token_loss.needs_entropy else None
        dx = torch.empty((n, x.shape[1]), **f32) if need_x else None
        # a declared upstream gradient: dW goes straight into the accumulator, scaled by it
        into = p.weight_grad_accumulator if p.upstream_grad is not None else None
        if into is not None and need_w:
            check_not_recomputed()  # before anything is added
        dw = (dw_sum if dw_sum is not None else torch.empty(weight.shape, **f32)) \
            if need_w and into is None else None
        need_grad = need_x or need_w
        # dz holds `chunk_size` tokens (the K of each dW product: fewer passes over the fp32
        # accumulator); their fp32 logits are made `logits_rows` tokens at a time (the backend
        # says: half a chunk, the chunk being sized for that, or all of it where it fits).
        c = min(p.chunk_size, n)
        if defer_weight_grad and (c < n or into is not None or not need_w or dw_sum is not None):
            raise ValueError("defer_weight_grad: needs the call in one chunk and dW returned")
        cz = self.logits_rows(c, n, p.chunk_size, v_local, x.element_size(), into is not None)
        z = torch.empty((cz, v_local), **f32)
        dz = torch.empty((c, v_local), dtype=x.dtype, device=x.device) if need_grad else None
        with adding_into(into if need_w else None) as adding:
            for start in range(0, n, c):
                end = min(start + c, n)
                for s0 in range(start, end, cz):
                    s1 = min(s0 + cz, end)
                    rows = slice(s0, s1)
                    zc = rows_of(z, slice(0, s1 - s0))
                    self.logits(rows_of(x, rows), weight, zc)
                    self.row_loss(zc, p, rows, rows_of(local_label, rows), token_loss,
                                  rows_of(dz, slice(s0 - start, s1 - start)) if need_grad else None,
                                  rows_of(loss, rows), rows_of(logprob, rows),
                                  None if entropy is None else rows_of(entropy, rows))
                if not need_grad:
                    continue
                xc, dzc = rows_of(x, slice(start, end)), rows_of(dz, slice(0, end - start))
                if need_x:
                    self.hidden_grad(dzc, weight, rows_of(dx, slice(start, end)))
                if need_w and into is not None:
                    addmm_f32_(into, dzc.t(), xc, alpha=p.upstream_grad)
                    # after: an error forming the product's operands (memory) added nothing
                    adding["added"] = True
                elif need_w and defer_weight_grad:
                    return FusedLoss(loss, logprob, entropy, dx, None, dz)
                elif need_w:
                    if start == 0 and dw_sum is None:
                        mm_f32(dzc.t(), xc, out=dw)
                    else:
                        addmm_f32_(dw, dzc.t(), xc)
            return FusedLoss(loss, logprob, entropy, dx, dw)


def upstream_grads(valid: torch.Tensor, g_logprob: Optional[torch.Tensor], g_entropy: Optional[torch.Tensor],
                   like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Backend.grads`' upstream gradients as dense float32 ``[N]``: 0 where the token is
    ignored (a select, not a product: NaN there is no input) or where there is none."""
    zero = torch.zeros_like(like) if g_logprob is None or g_entropy is None else None
    return tuple(zero if g is None else torch.where(valid, g.float(), 0.0) for g in (g_logprob, g_entropy))


def rows_of(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """``t[rows]``, or ``t`` itself where ``rows`` is all of it: a call of one chunk makes no
    views (each costs the host a few microseconds, and small calls are bound by the host)."""
    if rows.start == 0 and rows.stop == t.shape[0]:
        return t
    return t[rows]


def rescaled(stats: LocalStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sumexp`` and ``plogp`` of ``stats`` re-expressed relative to ``new_max`` (>= its max),
    so partial statistics over disjoint vocab ranges can be added."""
    shift = stats.max - new_max
    alpha = torch.exp(shift)
    return stats.sumexp * alpha, (stats.plogp + shift * stats.sumexp) * alpha


class GlobalStats(NamedTuple):
    """Float32 ``[N]`` statistics of the full vocabulary: ``logZ = max + log_s``, kept in two
    parts (see the module docstring), the entropy, and the label's logit."""

    max: torch.Tensor
    log_s: torch.Tensor
    entropy: torch.Tensor
    target: torch.Tensor

    def logprob(self) -> torch.Tensor:
        return (self.target - self.max) - self.log_s


def combine(stats: LocalStats, group, ordered: bool = False) -> GlobalStats:
    """Shard statistics -> global statistics. Split over ranks: every rank's four ``[N]``
    statistics gathered in one collective, and summed here in rank order, the same bits on
    every rank (``ordered`` holds whatever its value: the sum's order is never a collective's);
    a MAX and an ordered SUM all-reduce took three collectives and twice the launches, which
    at RL's small micro-batches cost the host more than the GPU's work."""
    if group_rank_size(group)[1] == 1:  # the shard is the vocabulary
        gmax, s, a, target = stats
    else:
        every = gather_tokens(torch.stack([stats.max, stats.sumexp, stats.plogp, stats.target]).unsqueeze(0),
                              group)  # [world, 4, N]
        gmax = every[:, 0].amax(dim=0)
        terms = torch.stack([*rescaled(LocalStats(*every.unbind(1)), gmax), every[:, 3]], dim=1)
        summed = terms[0].clone()
        for term in terms[1:]:  # rank order
            summed.add_(term)
        s, a, target = summed[0], summed[1], summed[2]
    log_s = torch.log(s)
    return GlobalStats(gmax, log_s, log_s - a / s, target)


def label_is_row_max(stats: GlobalStats) -> torch.Tensor:
    """Whether each token's label logit is the largest of its row (the label is the argmax):
    MTP acceptance. The label's logit may be summed in another order than the row's maximum
    (the Triton backend's separate dot), so equality is taken to 8 float32 ulps of the maximum."""
    return stats.target >= stats.max - stats.max.abs().clamp(min=1.0) * 2.0**-20


def local_labels(labels, valid, vocab_start: int, v_local: int) -> torch.Tensor:
    """Labels as rows of this rank's shard; -1 where the rank does not own the label (or the
    position is ignored)."""
    local = labels - vocab_start
    return torch.where((local >= 0) & (local < v_local) & valid, local, -1)

