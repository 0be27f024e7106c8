"""Activation checkpointing around the fused losses, whose gradients are formed in the forward.

Inside a non-reentrant ``torch.utils.checkpoint`` region every saved tensor is packed by the
region's hooks, and unpacking one re-runs the region. The losses take derivatives inside their
forward (``term_grads``); unshielded, each chunk re-ran the whole region during the forward, and
a declared ``upstream_grad`` added into ``main_grad`` once per run.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mcore_hooks import LinearCEProcessor, PolicyLossProcessor
from mcore_hooks.kernels import PolicyLoss, linear_policy_loss
from mcore_hooks.testing import hook_keywords

from ddp_like import ddp_like

CFG = PolicyLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)


def _problem(seed=4, n=12, h=8, v=30):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (n,), generator=g)
    inputs = {"old_logprobs": -torch.rand(n, generator=g) * 4, "advantages": torch.randn(n, generator=g),
              "ref_logprobs": -torch.rand(n, generator=g) * 4}
    return x, w, labels, inputs, torch.full((n,), 1.0 / n)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_region_runs_once_and_the_gradients_are_exact(reentrant):
    """4 chunks: the region's forward runs once (twice with the recomputation), not once per
    chunk; values and gradients bitwise those without checkpointing."""
    x, w, labels, inputs, tw = _problem()
    runs = []

    def region(xr, wr):
        runs.append(1)
        return linear_policy_loss(xr.sin(), wr, labels, token_weight=tw, loss=CFG, inputs=inputs,
                                  chunk_size=3).loss

    def grads(use_checkpoint):
        runs.clear()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = checkpoint(region, xr, wr, use_reentrant=reentrant) if use_checkpoint else region(xr, wr)
        forward_runs = len(runs)
        loss.backward()
        return loss.detach(), xr.grad, wr.grad, forward_runs, len(runs)

    ref = grads(False)
    got = grads(True)
    assert got[3] == 1 and got[4] == 2  # one forward, one recomputation
    for a, b in zip(got[:3], ref[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [
    lambda up: PolicyLossProcessor(loss=CFG, upstream_grad=up),
    lambda up: LinearCEProcessor(reduction="mean", upstream_grad=up),
], ids=["policy", "linear-ce"])
def test_main_grad_inside_a_checkpointed_region(make):
    """With the weight's gradient going into ``main_grad``: without ``upstream_grad`` it is added
    in the backward, once, exactly as outside the region; a declared ``upstream_grad`` (added in
    the forward, which the region runs again) is refused before anything is written."""
    g = torch.Generator().manual_seed(5)
    s, b, h, v = 6, 2, 8, 30
    torch.manual_seed(0)
    layer = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(s, b, h, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    ctx = {"old_logprobs": -torch.rand(b, s, generator=g) * 4, "advantages": torch.randn(b, s, generator=g),
           "ref_logprobs": -torch.rand(b, s, generator=g) * 4}
    config = types.SimpleNamespace(context_parallel_size=1, gradient_accumulation_fusion=True)

    def run(processor, use_checkpoint):
        handle = ddp_like(layer.weight)
        hr = hidden.clone().requires_grad_()

        def region(hh):
            kw = hook_keywords(hh, layer, labels=labels, context=ctx)
            kw["config"] = config
            out = processor(**kw)
            return out["loss"] if isinstance(out, dict) else out

        try:
            loss = checkpoint(region, hr, use_reentrant=False) if use_checkpoint else region(hr)
            (loss * 0.5).backward()
            return layer.weight.main_grad.clone(), hr.grad
        finally:
            handle.remove()

    ref_w, ref_h = run(make(None), False)
    got_w, got_h = run(make(None), True)
    assert torch.equal(got_w, ref_w) and torch.equal(got_h, ref_h)
    # declared: exact outside a region
    dec_w, _ = run(make(0.5), False)
    assert ((dec_w - ref_w).norm() / ref_w.norm()) < 1e-6
    # ... refused inside one, with main_grad untouched
    handle = ddp_like(layer.weight)
    try:
        kw = hook_keywords(hidden.clone().requires_grad_(), layer, labels=labels, context=ctx)
        kw["config"] = config
        with pytest.raises(ValueError, match="upstream_grad: the loss is computed under saved-tensor hooks"):
            checkpoint(lambda: make(0.5)(**kw), use_reentrant=False)
        assert not layer.weight.main_grad.any()
    finally:
        handle.remove()


def test_a_declared_upstream_grad_in_a_reentrant_recomputation_is_refused():
    """A reentrant checkpoint runs the forward without grad (nothing is added then) and again
    inside the backward: that second forward would add into main_grad, so it is refused there,
    and nothing was written."""
    g = torch.Generator().manual_seed(6)
    s, b, h, v = 4, 2, 8, 30
    layer = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(s, b, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, s), generator=g)
    config = types.SimpleNamespace(context_parallel_size=1, gradient_accumulation_fusion=True)
    handle = ddp_like(layer.weight)
    try:
        def region(hh):
            kw = hook_keywords(hh, layer, labels=labels)
            kw["config"] = config
            return LinearCEProcessor(reduction="sum", upstream_grad=1.0)(**kw)

        loss = checkpoint(region, hidden, use_reentrant=True)
        assert not layer.weight.main_grad.any()
        with pytest.raises(ValueError, match="upstream_grad: the loss is computed inside a backward pass"):
            loss.backward()
        assert not layer.weight.main_grad.any()
    finally:
        handle.remove()
