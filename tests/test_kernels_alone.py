"""The kernels on torch alone: no Megatron Core imported (CI also runs this file in a venv without
megatron-core), the vocabulary split over plain ``torch.distributed`` gloo ranks.

Float32 inputs against a float64 reference: each value sums O(vocab) float32 terms of size
O(1), so 1e-5 relative to the O(1) results bounds their rounding (vocab 50) with room."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_gloo_ranks

from mcore_hooks.kernels import PolicyLoss, VocabParallel, linear_cross_entropy, linear_logprob_entropy, linear_policy_loss

pytestmark = pytest.mark.release_independent

N, H, V = 12, 6, 50


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = -100
    return x, w, y


def _reference(x, w, y):
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    logp = torch.log_softmax(xd @ wd.t() / 0.9, -1)
    valid = y != -100
    lp = torch.where(valid, logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), xd.grad, wd.grad


def _ours(x, w, y, parallel=VocabParallel()):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    r = linear_logprob_entropy(x, w, y, temperature=0.9, parallel=parallel, backend="torch")
    (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
    return r.logprob.detach(), r.entropy.detach(), x.grad, w.grad


def test_importing_and_running_the_kernels_imports_no_megatron():
    code = textwrap.dedent("""
        import sys, torch
        from mcore_hooks.kernels import linear_cross_entropy, linear_logprob_entropy
        x, w = torch.randn(4, 3, requires_grad=True), torch.randn(7, 3, requires_grad=True)
        y = torch.tensor([1, 2, 3, -100])
        (linear_logprob_entropy(x, w, y).logprob.sum() + linear_cross_entropy(x, w, y)).backward()
        loaded = sorted(m for m in sys.modules if m.startswith("megatron"))
        assert not loaded, loaded
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr


def test_values_and_gradients_against_float64():
    x, w, y = _data()
    for a, r in zip(_ours(x, w, y), _reference(x, w, y)):
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5)


def _policy_inputs() -> dict:
    g = torch.Generator().manual_seed(2)
    return {"old_logprobs": -torch.rand(N, generator=g), "advantages": torch.randn(N, generator=g)}


def _rank(rank: int, world: int) -> tuple:
    x, w, y = _data()
    v = V // world
    shard = w[rank * v:(rank + 1) * v]
    par = VocabParallel(dist.group.WORLD, rank * v)
    lp, ent, dx, dw = _ours(x, shard, y, par)
    tw = torch.rand(N, generator=torch.Generator().manual_seed(1))
    ce = linear_cross_entropy(x, shard, y, token_weight=tw, parallel=par, backend="torch")
    pl = linear_policy_loss(x, shard, y, token_weight=tw, loss=PolicyLoss(), inputs=_policy_inputs(),
                            parallel=par, backend="torch")
    return (rank, *(t.tolist() for t in (lp, ent, dx, dw)), float(ce), float(pl.loss))


def test_the_vocabulary_split_over_plain_torch_distributed_ranks():
    """Two gloo ranks, each a vocabulary shard, the group from ``torch.distributed`` (no Megatron
    parallel state): each rank's results equal the unsplit call's, and its weight gradient is
    its shard of the unsplit one."""
    world = 2
    results = run_gloo_ranks(_rank, world)
    x, w, y = _data()
    lp, ent, dx, dw = _ours(x, w, y)
    tw = torch.rand(N, generator=torch.Generator().manual_seed(1))
    ce = float(linear_cross_entropy(x, w, y, token_weight=tw, backend="torch"))
    pl = float(linear_policy_loss(x, w, y, token_weight=tw, inputs=_policy_inputs(), backend="torch").loss)
    v = V // world
    for rank, *arrays, r_ce, r_pl in results:
        r_lp, r_ent, r_dx, r_dw = (torch.tensor(a) for a in arrays)
        torch.testing.assert_close(r_lp, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_ent, ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_dx, dx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_dw, dw[rank * v:(rank + 1) * v], rtol=1e-5, atol=1e-5)
        assert abs(r_ce - ce) <= 1e-5 * max(1.0, abs(ce))
        assert abs(r_pl - pl) <= 1e-5 * max(1.0, abs(pl))
