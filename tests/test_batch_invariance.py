"""Batch invariance (``batch_invariant=True``, the default), bitwise, on the torch backend (the
Triton backend's in ``test_gpu.py``): a token's results and its row of the hidden states' gradient do not change
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
from mcore_hooks.kernels.common.invariant import InvariantBlocks, block_rows
from mcore_hooks.testing import hook_keywords

H, V, PROBE = 256, 1000, 7
WIDE = (256, 1000)  # (H, V) of the processors' test: wide enough for a BLAS to pick by shape
BLOCK = block_rows(torch.device("cpu"))
SIZES = (7, BLOCK - 1, BLOCK + 5, 1000)  # from the second block on, the probe tokens are in the last
KINDS = ["logprob-entropy", "kept-set", "truncation", "selected", "cross-entropy", "policy"]


def _pool(dtype):
    g = torch.Generator().manual_seed(0)
    n = max(SIZES) + 100
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
    common = dict(backend="torch", temperature=0.8)  # batch invariance: the default
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
    """Both ways the ids' logits are made (kernels/passes/candidates.py)."""
    from mcore_hooks.kernels.passes import candidates

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
        r = linear_logprob_entropy(x[rows], wg, y[rows], backend="torch", weight_grad_accumulator=acc)
        (r.logprob.sum() + 0.3 * r.entropy.sum()).backward()
        return acc

    whole = into(torch.zeros(V, H), slice(0, 2 * BLOCK))
    parts = into(into(torch.zeros(V, H), slice(0, BLOCK)), slice(BLOCK, 2 * BLOCK))
    assert torch.equal(whole, parts)


def _every_processor(**opts):
    """Every bundled processor and integration, default options but ``opts`` (a loss summed
    over tokens: no token's weight follows the batch), with the context it reads
    (``[b, s, ...]``)."""
    from mcore_hooks import (EntropyProcessor, LinearCEProcessor, PolicyLossProcessor,
                             SelectedLogprobProcessor, TopKDistillationProcessor, Truncation)
    from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
    from mcore_hooks.integrations.verl import FusedOutputProcessorContext, VerlFusedProcessor
    from mcore_hooks.kernels import PolicyLoss

    b, s = 40, 6
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, WIDE[1], (b, s, 4), generator=g)
    teacher = torch.log_softmax(torch.randn(b, s, 4, generator=g), -1)
    policy = {"old_logprobs": -3 * torch.rand(b, s, generator=g), "advantages": torch.randn(b, s, generator=g)}
    return [
        (FusedLogprobProcessor(**opts), None),
        (FusedLogprobProcessor(kept_set=Truncation(top_k=8, top_p=0.9), **opts), None),
        (EntropyProcessor(**opts), None),
        (LogprobEntropyProcessor(**opts), None),
        (LinearCEProcessor(reduction="sum", **opts), None),
        (PolicyLossProcessor(loss=PolicyLoss(entropy_coef=0.01), aggregation="token-sum", **opts), policy),
        (SelectedLogprobProcessor(with_label=True, **opts), {"selected_ids": ids}),
        (TopKDistillationProcessor(aggregation="token-sum", **opts),
         {"teacher_ids": ids, "teacher_logprobs": teacher}),
        (VerlFusedProcessor(**opts), FusedOutputProcessorContext(temperature=0.8)),
        (NemoRLLogprobProcessor(**opts), None),
    ]


def _per_sample(out, b: int) -> tuple[list, torch.Tensor]:
    """Every tensor a processor returns with a sample axis first (``[b, ...]``; verl's flattened
    ``[b * s]`` made ``[b, s]``; bool ones too), and what to differentiate (the float ones and
    any scalar loss). Anything else it returns fails the test: nothing is dropped unseen."""
    if isinstance(out, torch.Tensor):
        parts = [out]
    elif isinstance(out, dict):
        parts = list(out.values())
    elif isinstance(out, tuple):
        parts = list(out)
    else:  # verl's output object: its per-token fields (hidden_states is the hook's input)
        parts = [out.log_probs, out.entropy]
    parts = [p for p in parts if p is not None]
    assert all(isinstance(p, torch.Tensor) for p in parts), [type(p).__name__ for p in parts]
    per = [p.view(b, -1) if p.dim() == 1 else p for p in parts if p.dim() >= 1]
    assert all(p.dim() >= 1 or p.is_floating_point() for p in parts)  # a scalar: the loss
    return per, sum(p.float().sum() for p in parts if p.requires_grad)


def _through_the_hook(processors) -> list[list[str]]:
    """For each processor, which samples' outputs or hidden-state gradient rows differ between
    the whole call of 40 samples and calls of fewer (alone, first, last, in the middle)."""
    b, s = 40, 6
    h, v = WIDE
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(s, b, h, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)

    def run(processor, context, samples):
        hs = hidden[:, samples].clone().requires_grad_()
        ctx = {k: t[samples] for k, t in context.items()} if isinstance(context, dict) else context
        kw = hook_keywords(hs, layer, labels=labels[samples], input_ids=labels[samples], context=ctx)
        per, loss = _per_sample(processor(**kw), hs.shape[1])
        loss.backward()
        return [p.detach() for p in per] + [hs.grad.transpose(0, 1)]

    differs = []
    for processor, context in processors:
        whole = run(processor, context, slice(0, b))
        moved = []
        for i, part in ((0, slice(0, 1)), (0, slice(0, 7)), (39, slice(39, 40)), (6, slice(0, 7)),
                        (20, slice(13, 33))):
            got = run(processor, context, part)
            assert len(got) == len(whole)
            j = i - part.start
            moved += [f"sample {i} of {part}, output {k}" for k, (a, c) in enumerate(zip(whole, got))
                      if not torch.equal(a[i], c[j])]
        differs.append(moved)
    return differs


def test_every_processor_through_the_hook_is_batch_invariant_by_default():
    """The default options, on the CPU (the torch backend): each sample's outputs and its rows
    of the hidden states' gradient are the same bits alone, first, last or in the middle of 40
    samples, for every bundled processor and integration. Where this machine's BLAS forms a row
    of ``x @ W.T`` differently with fewer rows (this one's MKL did at 6 rows against 240), the
    opt-out must move some result: the control that the default's blocks are what hold."""
    for (processor, _), moved in zip(_every_processor(), _through_the_hook(_every_processor())):
        assert not moved, (type(processor).__name__, moved)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(240, WIDE[0], generator=g), torch.randn(WIDE[1], WIDE[0], generator=g)
    if not torch.equal((x[:6] @ w.t())[0], (x @ w.t())[0]):
        assert any(_through_the_hook(_every_processor(batch_invariant=False)))


def test_the_opt_out_is_taken_and_checked(monkeypatch):
    """``batch_invariant=False`` reaches the kernels: the torch backend runs on the call's own
    shapes, no fixed blocks; a non-bool is refused before anything runs."""
    from mcore_hooks.kernels.passes import ops, stats_op

    names = []
    real = ops._backend
    # where the statistics pass looks its backend up
    monkeypatch.setattr(stats_op, "_backend", lambda name, device: names.append(name) or real(name, device))
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(H, V, bias=False)
    kw = hook_keywords(torch.randn(40, 1, H, generator=g), layer,
                       labels=torch.randint(0, V, (1, 40), generator=g))
    LogprobEntropyProcessor(batch_invariant=False)(**kw)
    LogprobEntropyProcessor()(**kw)
    assert names == ["torch", "torch+invariant"]
    assert not isinstance(real("torch", torch.device("cpu")), InvariantBlocks)
    assert isinstance(real("torch+invariant", torch.device("cpu")), InvariantBlocks)
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
    in rank order with batch invariance (the default). A collective's own order depends on the message
    size and the element's place in it (with 4 ranks the probes' dX rows differed in their last
    bits without this)."""
    for rank, differs in enumerate(run_gloo_ranks(_tp_rank, 4)):
        assert not differs, (rank, differs)


def _ordered_sums(rank: int, world: int) -> tuple:
    """Order-sensitive terms (magnitudes 1e-3 to 1e8) summed by batch invariance's two
    reductions; ``[13, 3]``: not a multiple of the group's size (padded)."""
    from mcore_hooks.kernels.common import comm

    g = torch.Generator().manual_seed(10 + rank)
    t = torch.randn(13, 3, generator=g) * 10.0 ** torch.randint(-3, 9, (13, 3), generator=g)
    x = (torch.randn(4 * world, 5, generator=g)
         * 10.0 ** torch.randint(-3, 4, (4 * world, 5), generator=g)).bfloat16()
    s = comm.all_reduce(t.clone(), dist.ReduceOp.SUM, dist.group.WORLD, ordered=True)
    r = comm.reduce_scatter_tokens(x.clone(), dist.group.WORLD, ordered=True)
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
