"""Second derivatives through every entry point, backend and route.

No kernel here forms a differentiable gradient: the log-prob pass's backward takes the forward's
statistics (max, log-sum-exp) as constants, the kept sets' logits come from non-differentiated
gathers, and the fused losses form their gradients in the forward. So a gradient taken with
``create_graph=True`` is the first-order gradient, the same bits as without it, and
differentiating it again raises, naming the pass, before any of it is computed: never a
silently wrong second derivative (a gradient penalty, a Hessian-vector product), through
``.backward()`` or ``torch.autograd.grad`` alike. On the GPU the same Functions run (the
``gpu``-marked tests of ``test_triton_backend.py`` cover the fused losses' refusal there).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mcore_hooks.kernels import (
    Truncation,
    linear_cross_entropy,
    linear_logprob_entropy,
    linear_policy_loss,
)

pytestmark = pytest.mark.release_independent

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])
N, H, V = 7, 16, 40


def _lp(**kw):
    def f(x, w, y):
        r = linear_logprob_entropy(x, w, y, **kw)
        return r.logprob.sum() + 0.5 * r.entropy.sum()
    return f


ROUTES = {
    "log-prob + entropy": lambda backend: _lp(backend=backend),
    "not batch invariant": lambda backend: _lp(backend=backend, batch_invariant=False),
    "temperature per token": lambda backend: _lp(backend=backend, temperature=torch.linspace(0.6, 1.3, N, device=DEVICE)),
    "entropy only": lambda backend: lambda x, w, y: linear_logprob_entropy(x, w, None, backend=backend).entropy.sum(),
    "kept ids": lambda backend: lambda x, w, y: _kept(x, w, y, backend),
    "top-k truncation": lambda backend: _lp(backend=backend, truncation=Truncation(top_k=5, top_p=0.9)),
    "whole-vocabulary top-p": lambda backend: _lp(backend=backend, truncation=Truncation(top_k=-1, top_p=0.9)),
    "sglang top-p": lambda backend: _lp(backend=backend, truncation=Truncation(top_k=-1, top_p=0.8, engine="sglang")),
    "selected ids": lambda backend: lambda x, w, y: _selected_ids(x, w, y, backend),
    "cross-entropy": lambda backend: lambda x, w, y: linear_cross_entropy(x, w, y, backend=backend),
    "policy loss": lambda backend: lambda x, w, y: linear_policy_loss(
        x, w, y, token_weight=torch.full((N,), 1.0 / N, device=DEVICE),
        inputs={"advantages": torch.linspace(-1, 1, N, device=DEVICE)}, backend=backend,
        loss=lambda lp, ent, advantages: -advantages * lp).loss,
}


def _kept(x, w, y, backend):
    ids = torch.stack([y, (y + 1) % V, (y + 3) % V, torch.full_like(y, -1)], dim=1)
    r = linear_logprob_entropy(x, w, y, kept_ids=ids, backend=backend)
    return r.logprob.sum() + 0.5 * r.entropy.sum()


def _selected_ids(x, w, y, backend):
    ids = torch.stack([(y + 1) % V, (y + 7) % V, torch.full_like(y, -1)], dim=1)
    r = linear_logprob_entropy(x, w, y, selected_ids=ids, backend=backend)
    return r.logprob.sum() + r.selected.sum() + 0.5 * r.entropy.sum()


def _inputs(backend: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if backend == "torch" else torch.float16
    x = torch.randn(N, H, generator=g).to(DEVICE, dtype)
    w = (torch.randn(V, H, generator=g) / 4).to(DEVICE, dtype)
    y = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return x, w, y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("route", list(ROUTES))
def test_create_graph_gives_the_first_order_gradient_and_a_second_derivative_is_refused(route, backend):
    f = ROUTES[route](backend)
    x0, w0, y = _inputs(backend, seed=hash(route) % 1000)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    plain = torch.autograd.grad(f(x, w, y), (x, w))
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    gx, gw = torch.autograd.grad(f(x, w, y), (x, w), create_graph=True)
    assert torch.equal(gx.detach(), plain[0]) and torch.equal(gw.detach(), plain[1])
    penalty = gx.float().square().sum() + gw.float().square().sum()
    for wrt in (x, w):  # autograd.grad finds the refusal on the path to either input
        with pytest.raises(RuntimeError, match="cannot be differentiated again"):
            torch.autograd.grad(penalty, wrt, retain_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        penalty.backward()
    assert x.grad is None and w.grad is None  # refused before anything reached the inputs


def test_the_refusal_names_the_pass():
    x0, w0, y = _inputs("torch", seed=3)
    x = x0.clone().requires_grad_()
    r = linear_logprob_entropy(x, w0, y, backend="torch")
    gx, = torch.autograd.grad(r.logprob.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"the log-prob pass \(linear_logprob_entropy\): its gradients are made "
                                           r"from the forward's statistics"):
        gx.square().sum().backward()
