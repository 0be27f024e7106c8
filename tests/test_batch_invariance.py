"""Batch invariance (``batch_invariant=True``), bitwise, on the torch backend (the Triton backend's
in ``test_gpu.py``): a token's results and its row of the hidden states' gradient do not change
with the other tokens in the call, their number, or where the token sits; a call split at block
boundaries into micro-batches adds the same bits into ``main_grad``."""

from __future__ import annotations

import queue as queue_module
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _tp_rank(rank: int, world: int, port: int, queue) -> None:
    """One rank of a vocabulary split over ``world`` gloo ranks: for every kind, with and
    without sequence parallelism, whether the probe tokens' results (and dX rows) in a call of
    their own equal theirs at other places in a call of 128 tokens, bitwise."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x, w, y, kept = _pool(torch.float32)
        v = V // world
        shard = w[rank * v:(rank + 1) * v]
        g = torch.Generator().manual_seed(4)
        probe = list(range(8))  # 8: a share of 2 tokens a rank under sequence parallelism
        others = [int(i) for i in torch.randperm(len(x) - 8, generator=g)[:120] + 8]
        mixed = others[:50] + probe[:3] + others[50:90] + probe[3:] + others[90:]
        at = [mixed.index(i) for i in probe]
        differs = []
        for sp in (False, True):
            par = VocabParallel(dist.group.WORLD, rank * v, sequence_parallel=sp)
            for kind in KINDS:
                alone, _ = _call(kind, x, shard, y, kept, probe, par)
                got, _ = _call(kind, x, shard, y, kept, mixed, par)
                differs += [f"{kind}{' sp' if sp else ''}: output {j}"
                            for j, (a, b) in enumerate(zip(alone, got)) if not torch.equal(a, b[at])]
        queue.put((rank, differs))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_tokens_results_do_not_depend_on_the_rest_of_the_call_over_four_ranks():
    """Tensor parallelism of 4 (gloo): the statistics' and dX's sums over the ranks are added
    in rank order in the batch-invariant mode. A collective's own order depends on the message
    size and the element's place in it (with 4 ranks the probes' results differed in their last
    bits without this)."""
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, world, port, queue)) for r in range(world)]
    results = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 240
        while len(results) < world:  # a rank that dies or hangs fails the test, never hangs it
            try:
                results.append(queue.get(timeout=5))
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank exited with {dead}"
                assert time.monotonic() < deadline, "the ranks did not answer within 240 s"
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    for rank, differs in sorted(results):
        assert not differs, (rank, differs)
