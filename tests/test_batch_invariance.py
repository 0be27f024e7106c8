"""Batch invariance (``batch_invariant=True``), bitwise, on the torch backend (the Triton backend's
in ``test_gpu.py``): a token's results and its row of the hidden states' gradient do not change
with the other tokens in the call, their number, or where the token sits; a call split at block
boundaries into micro-batches adds the same bits into ``main_grad``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_gloo_ranks

from mcore_hooks import FusedLogprobProcessor, LogprobEntropyProcessor
from mcore_hooks.kernels import (
    PolicyLoss,
    Truncation,
    VocabParallel,
    linear_cross_entropy,
    linear_logprob_entropy,
    linear_policy_loss,
)
from mcore_hooks.kernels.invariant import BLOCK
from mcore_hooks.testing import hook_keywords

H, V, PROBE = 16, 64, 7
SIZES = (7, 128, 1000, BLOCK + 100)  # the last: the probe tokens in the second block
KINDS = ["logprob-entropy", "kept-set", "truncation", "selected", "cross-entropy", "policy"]


def _pool(dtype):
    g = torch.Generator().manual_seed(0)
    n = BLOCK + 100
    x = torch.randn(n, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, V, (n,), generator=g)
    kept = torch.stack([(y + j) % V for j in range(5)], dim=1)
    return x, w, y, kept


def _call(kind, x, w, y, kept, rows, parallel=None):
    """Run ``kind`` on the tokens ``rows`` of the pool; the per-token results and dX rows (under
    ``parallel``, ``w`` is this rank's vocabulary shard; with sequence parallelism the rank
    takes its share of the tokens, and the dX rows are gathered back)."""
    xs, sp = x[rows], parallel is not None and parallel.sequence_parallel
    if sp:
        xs = xs.chunk(dist.get_world_size())[dist.get_rank()]
    xg, wg = xs.clone().requires_grad_(), w.clone().requires_grad_()
    n = len(rows)
    common = dict(backend="torch", batch_invariant=True, temperature=0.8)
    if parallel is not None:
        common["parallel"] = parallel
    if kind == "logprob-entropy":
        r = linear_logprob_entropy(xg, wg, y[rows], **common)
        out, loss = (r.logprob, r.entropy), r.logprob.sum() + 0.5 * r.entropy.sum()
    elif kind == "kept-set":
        r = linear_logprob_entropy(xg, wg, y[rows], kept_ids=kept[rows], **common)
        out, loss = (r.logprob, r.entropy), r.logprob.sum() + 0.5 * r.entropy.sum()
    elif kind == "truncation":
        r = linear_logprob_entropy(xg, wg, y[rows], truncation=Truncation(top_k=8, top_p=0.9), **common)
        out, loss = (r.logprob,), r.logprob.sum()
    elif kind == "selected":
        r = linear_logprob_entropy(xg, wg, y[rows], selected_ids=kept[rows], **common)
        out, loss = (r.selected, r.logprob), r.selected.sum()
    elif kind == "cross-entropy":
        loss = linear_cross_entropy(xg, wg, y[rows], **common)
        out = ()
    else:  # the fused policy loss
        inputs = {"old_logprobs": -torch.ones(n), "advantages": torch.linspace(-1, 1, len(x))[rows]}
        r = linear_policy_loss(xg, wg, y[rows], token_weight=torch.ones(n), inputs=inputs,
                               loss=PolicyLoss(entropy_coef=0.01), **common)
        out, loss = (r.logprob, r.entropy), r.loss
    loss.backward()
    dx = xg.grad
    if sp:
        shards = [torch.empty_like(dx) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, dx)
        dx = torch.cat(shards)
    return [o.detach() for o in out] + [dx], wg.grad


@pytest.fixture(params=["gather", "dense"])
def path(request, monkeypatch):
    """Both ways the ids' logits are made (kernels/candidates.py)."""
    from mcore_hooks.kernels import candidates

    monkeypatch.setattr(candidates, "gathers", lambda k, v: request.param == "gather")
    return request.param


@pytest.mark.parametrize("kind", KINDS)
def test_a_tokens_results_do_not_depend_on_the_rest_of_the_call(kind, path):
    x, w, y, kept = _pool(torch.float32)
    probe = list(range(PROBE))
    alone, _ = _call(kind, x, w, y, kept, probe)
    g = torch.Generator().manual_seed(1)
    for n in SIZES:
        others = [int(i) for i in torch.randperm(len(x) - PROBE, generator=g)[: n - PROBE] + PROBE]
        at = n - PROBE  # the probe tokens last: other positions, other blocks
        got, _ = _call(kind, x, w, y, kept, others + probe)
        for a, b in zip(alone, got):
            assert torch.equal(a, b[at:]), (kind, n)


def test_a_call_split_at_a_block_boundary_adds_the_same_bits_into_main_grad():
    """Block-aligned micro-batches adding into one float32 accumulator (Megatron's main_grad)
    give the whole call's bits: the blocks' products go into it one after another either way."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * BLOCK, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * 0.5).bfloat16()
    y = torch.randint(0, V, (2 * BLOCK,), generator=g)

    def into(acc, rows):
        wg = w.clone().requires_grad_()
        r = linear_logprob_entropy(x[rows], wg, y[rows], backend="torch", batch_invariant=True,
                                   weight_grad_accumulator=acc)
        (r.logprob.sum() + 0.3 * r.entropy.sum()).backward()
        return acc

    whole = into(torch.zeros(V, H), slice(0, 2 * BLOCK))
    parts = into(into(torch.zeros(V, H), slice(0, BLOCK)), slice(BLOCK, 2 * BLOCK))
    assert torch.equal(whole, parts)


def test_processors_take_the_option_through_the_hook():
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(40, 1, H, generator=g)
    labels = torch.randint(0, V, (1, 40), generator=g)
    outs = []
    for s in (40, 12):
        kw = hook_keywords(hidden[-s:], layer, labels=labels[:, -s:])
        out = LogprobEntropyProcessor(batch_invariant=True, backend="torch")(**kw)
        outs.append(out["logprobs"][:, -5:])
        assert FusedLogprobProcessor(batch_invariant=True)(**kw).shape == (1, s)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(TypeError, match="batch_invariant: expected True or False"):
        FusedLogprobProcessor(batch_invariant="yes")


def _tp_rank(rank: int, world: int) -> list[str]:
    """One rank of a vocabulary split over ``world`` gloo ranks: for every kind, with and
    without sequence parallelism, what differs between the probe tokens' results (and dX rows)
    in a call of their own and at other places in a call of 128 tokens, bitwise; and every SUM
    collective left to its own order (none may be: gloo keeps one order for small messages,
    NCCL does not)."""
    x, w, y, _ = _pool(torch.float32)
    kept = torch.stack([(y + 13 * j) % V for j in range(5)], dim=1)  # ids on every shard
    v = V // world
    shard = w[rank * v:(rank + 1) * v]
    g = torch.Generator().manual_seed(4)
    probe = list(range(8))  # 8: a share of 2 tokens a rank under sequence parallelism
    others = [int(i) for i in torch.randperm(len(x) - 8, generator=g)[:120] + 8]
    mixed = others[:50] + probe[:3] + others[50:90] + probe[3:] + others[90:]
    at = [mixed.index(i) for i in probe]
    differs = []
    real = dist.all_reduce, dist.reduce_scatter_tensor

    def all_reduce(t, op=dist.ReduceOp.SUM, **kw):
        if op == dist.ReduceOp.SUM:
            differs.append(f"an all_reduce SUM of {tuple(t.shape)}")
        return real[0](t, op, **kw)

    def reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, **kw):
        differs.append(f"a reduce_scatter of {tuple(t.shape)}")
        return real[1](out, t, op, **kw)

    dist.all_reduce, dist.reduce_scatter_tensor = all_reduce, reduce_scatter_tensor
    try:
        for sp in (False, True):
            par = VocabParallel(dist.group.WORLD, rank * v, sequence_parallel=sp)
            for kind in KINDS:
                alone, _ = _call(kind, x, shard, y, kept, probe, par)
                got, _ = _call(kind, x, shard, y, kept, mixed, par)
                differs += [f"{kind}{' sp' if sp else ''}: output {j}"
                            for j, (a, b) in enumerate(zip(alone, got)) if not torch.equal(a, b[at])]
    finally:
        dist.all_reduce, dist.reduce_scatter_tensor = real
    return differs


def test_a_tokens_results_do_not_depend_on_the_rest_of_the_call_over_four_ranks():
    """Tensor parallelism of 4 (gloo): the statistics' and dX's sums over the ranks are added
    in rank order in the batch-invariant mode. A collective's own order depends on the message
    size and the element's place in it (with 4 ranks the probes' dX rows differed in their last
    bits without this)."""
    for rank, differs in enumerate(run_gloo_ranks(_tp_rank, 4)):
        assert not differs, (rank, differs)


def _ordered_sums(rank: int, world: int) -> tuple:
    """Order-sensitive terms (magnitudes 1e-3 to 1e8) summed by the invariant mode's two
    reductions; ``[13, 3]``: not a multiple of the group's size (padded)."""
    from mcore_hooks.kernels import autograd as ag

    g = torch.Generator().manual_seed(10 + rank)
    t = torch.randn(13, 3, generator=g) * 10.0 ** torch.randint(-3, 9, (13, 3), generator=g)
    x = (torch.randn(4 * world, 5, generator=g)
         * 10.0 ** torch.randint(-3, 4, (4 * world, 5), generator=g)).bfloat16()
    s = ag.all_reduce(t.clone(), dist.ReduceOp.SUM, dist.group.WORLD, ordered=True)
    r = ag.reduce_scatter_tokens(x.clone(), dist.group.WORLD, ordered=True)
    return t.tolist(), s.tolist(), x.float().tolist(), r.float().tolist()


def test_the_invariant_sums_over_four_ranks_are_in_rank_order():
    """Each rank gets ``((t0 + t1) + t2) + t3`` in float32, rounded once to the input dtype:
    the all-reduce of any shape and the reduce-scatter of the token shards, bitwise."""
    world = 4
    out = run_gloo_ranks(_ordered_sums, world)
    t = [torch.tensor(o[0]) for o in out]
    x = [torch.tensor(o[2]) for o in out]
    want = t[0].clone()
    for term in t[1:]:
        want += term
    for rank, (_, s, _, r) in enumerate(out):
        assert torch.equal(torch.tensor(s), want), rank
        shard = x[0].chunk(world)[rank].clone()
        for term in x[1:]:
            shard += term.chunk(world)[rank]
        assert torch.equal(torch.tensor(r), shard.bfloat16().float()), rank
