"""The Triton backend against the torch backend and float64, on GPU or under Triton's interpreter.

On CPU the interpreter runs the kernels at tiny shapes in fp16 only: its ``tl.dot`` gives wrong
results for bf16 operands (seen with Triton 3.9: a 16x16 bf16 dot off by 1e10), so bf16 is
covered by the GPU run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mcore_hooks.kernels import VocabParallel, linear_cross_entropy, linear_logprob_entropy  # noqa: E402
from mcore_hooks.kernels.triton_backend import (  # noqa: E402
    triton_fused, triton_kernels, triton_losses, triton_tiles)
from mcore_hooks.testing import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.release_independent

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
GRAD_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel(a, b):
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-300)).item()


def close(a, b, tol):
    """Max error within ``tol`` of the larger of 1 and the reference's magnitude (refs may be 0)."""
    b = b.double()
    return (a.double() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _run(backend, x, w, labels, temperature, g1, g2, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    r = linear_logprob_entropy(x, w, labels, temperature=temperature, backend=backend, **kw)
    (r.logprob * g1 + r.entropy * g2).sum().backward()
    return r.logprob.detach(), r.entropy.detach(), x.grad, w.grad


def _reference(x, w, labels, temperature, g1, g2):
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    t = temperature.double()[:, None] if torch.is_tensor(temperature) else temperature
    logp = torch.log_softmax(x @ w.t() / t, -1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (lp * g1.double() + ent * g2.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad, w.grad


SHAPES = [  # (tokens, hidden, vocab): nothing divisible by the tiles
    (37, 40, 301),
    (130, 64, 257),
    (5, 16, 1),
    pytest.param((129, 96, 1031), marks=pytest.mark.slow),
    # hidden >= the vocab tile: the gradient chunk lives in the dX output
    pytest.param((40, 512, 1100), marks=pytest.mark.slow),
]
if ON_GPU:
    SHAPES += [(1000, 512, 32003), (4099, 1024, 151936 // 8 + 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_torch_backend_and_float64(shape, dtype):
    n, h, v = shape
    g = torch.Generator().manual_seed(n + v)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    labels[-1] = v - 1
    labels = labels.to(DEVICE)
    temperature = (torch.rand(n, generator=g) + 0.3).to(DEVICE)
    g1 = torch.randn(n, generator=g).to(DEVICE)
    g2 = torch.randn(n, generator=g).to(DEVICE)
    tri = _run("triton", x, w, labels, temperature, g1, g2)
    tor = _run("torch", x, w, labels, temperature, g1, g2, chunk_size=64)
    ref = _reference(x, w, labels, temperature, g1, g2)
    # values: fp32 logits in both backends, so within fp32 rounding of each other and of float64:
    # 2e-6 norm-wise, 1e-5 for any single element (the GPU's exp is approximate)
    for got, want in ((tri[0], ref[0]), (tri[1], ref[1]), (tri[0], tor[0]), (tri[1], tor[1])):
        assert close(got, want, 1e-5)
        assert want.norm() == 0 or rel(got, want) < 2e-6
    # gradients: both round the logit gradient to the input dtype before the matmuls
    for got, want, base in zip(tri[2:], ref[2:], tor[2:]):
        assert got.dtype == dtype
        if want.norm() > 0:
            assert rel(got, want) < GRAD_TOL[dtype]
            assert rel(got, want) <= 2 * rel(base, want) + 1e-3
    ignored = labels == -100
    assert (tri[0][ignored] == 0).all() and (tri[2][ignored] == 0).all()


def _count_gathered_dots(monkeypatch):
    """Count the Triton backend's gathered dot products (a fallback gives the same values, so
    the tests also check that the kernel ran)."""
    from mcore_hooks.kernels.triton_backend import triton_fused

    real = triton_fused.TritonFused.gathered_dots

    def counted(*args):
        counted.calls += 1
        return real(*args)

    counted.calls = 0
    monkeypatch.setattr(triton_fused.TritonFused, "gathered_dots", staticmethod(counted))
    return counted


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# the last: 3 ids and the label a token over 4200 words are gathered (4 * 1024 <= V: the
# Triton dot kernel); the others' logits come from dense products
@pytest.mark.parametrize("shape", SHAPES + [(33, 300, 4200)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("invariant", [False, True], ids=["opted-out", "batch-invariant"])
def test_triton_selected_ids_match_torch_backend_and_float64(shape, dtype, invariant, monkeypatch):
    """The given ids' gradients written over the Triton logit-gradient tiles (``extra``), and
    added in the torch backend's: values and gradients against float64 and the torch backend."""
    n, h, v = shape
    g = torch.Generator().manual_seed(n + v + 1)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    ids = torch.randint(0, v, (n, 3), generator=g).to(DEVICE)
    ids[0, 1] = -1
    if n > 2:  # a repeated id (its gradients add) and the label among the ids
        ids[1, 2], ids[2, 0] = ids[1, 0], labels[2]
    coeffs = torch.randn(n, 3, generator=g).to(DEVICE)

    def run(backend):
        xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        r = linear_logprob_entropy(xg, wg, labels, selected_ids=ids, temperature=0.9, backend=backend,
                                   batch_invariant=invariant)
        ((r.selected * coeffs).sum() + r.logprob.sum()).backward()
        return r.selected.detach(), xg.grad, wg.grad

    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    logp = torch.log_softmax(xd @ wd.t() / 0.9, -1)
    sel = torch.where(ids >= 0, logp.gather(1, ids.clamp(min=0)), 0.0)
    ((sel * coeffs.double()).sum() + logp.gather(1, labels[:, None]).sum()).backward()
    dots = _count_gathered_dots(monkeypatch)
    tri, tor = run("triton"), run("torch")
    assert dots.calls == (1 if 4 * 256 <= v else 0)  # the ids and the label: K + 1 = 4
    assert close(tri[0], sel.detach(), 1e-5) and close(tri[0], tor[0], 1e-5)
    for got, want, base in zip(tri[1:], (xd.grad, wd.grad), tor[1:]):
        if want.norm() > 0:  # a one-word vocabulary: every gradient is 0
            assert rel(got, want) < GRAD_TOL[dtype]
            assert rel(got, want) <= 2 * rel(base, want) + 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("invariant", [False, True], ids=["opted-out", "batch-invariant"])
def test_triton_kept_set_logits_from_the_dot_kernel(dtype, invariant, monkeypatch):
    """A kept set of 4 ids a token over 1100 words (4 * 256 <= V): the Triton backend takes the
    ids' logits from its gathered-dot kernel (the torch backend from a dense product). The
    renormalised log-probs, entropies and gradients against float64 and the torch backend."""
    n, h, v, k = 37, 300, 1100, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    ids = torch.randint(0, v, (n, k), generator=g)
    ids[:, 0] = labels = torch.randint(0, v, (n,), generator=g)
    ids[3, 2] = -1  # padding
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)

    def run(backend):
        xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        r = linear_logprob_entropy(xg, wg, labels, kept_ids=ids, temperature=0.9, backend=backend,
                                   batch_invariant=invariant)
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        return r.logprob.detach(), r.entropy.detach(), xg.grad, wg.grad

    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    z = (xd @ wd.t() / 0.9).gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
    logp = torch.log_softmax(z, -1)
    lp = logp[:, 0]
    ent = -(logp.exp() * logp.masked_fill(ids < 0, 0.0)).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    dots = _count_gathered_dots(monkeypatch)
    tri, tor = run("triton"), run("torch")
    # the invariant mode pads each row to 16 ids: past V/256 there, so a dense product
    assert dots.calls == (0 if invariant else 1)
    for got, want, base in zip(tri[:2], (lp.detach(), ent.detach()), tor[:2]):
        assert close(got, want, 1e-5) and close(got, base, 1e-5)
    for got, want, base in zip(tri[2:], (xd.grad, wd.grad), tor[2:]):
        assert rel(got, want) < GRAD_TOL[dtype]
        assert rel(got, want) <= 2 * rel(base, want) + 1e-3


def _run_ce(backend, x, w, labels, token_weight, temperature, grad_out, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(
        x, w, labels, token_weight=token_weight, temperature=temperature, backend=backend, **kw
    )
    (loss * grad_out).backward()
    return loss.detach(), x.grad, w.grad


@pytest.fixture(params=["in-forward", "in-forward-float32-dw", "in-backward"])
def route(request, monkeypatch):
    """Where a fused loss forms its gradients on Triton, chosen there by the hidden size
    (``TritonFused.forward_gradients_min_hidden``): all routes at these small shapes. In the
    forward, dW from the logit gradient kept for the backward (few tokens), or in float32 in
    the forward (``TritonFused.saved_dz_bytes`` 0 here)."""
    monkeypatch.setattr(triton_fused.TritonFused, "forward_gradients_min_hidden",
                        1 << 30 if request.param == "in-backward" else 0)
    if request.param == "in-forward-float32-dw":
        monkeypatch.setattr(triton_fused.TritonFused, "saved_dz_bytes", 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunk", [None, 16])
def test_triton_cross_entropy_matches_torch_backend(shape, dtype, chunk, route):
    """The reduced cross-entropy on Triton against torch's, by either route (the row passes'
    kernel over materialised logits, or the statistics pass and its backward)."""
    n, h, v = shape
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    labels = labels.to(DEVICE)
    tw = torch.rand(n, generator=g).to(DEVICE)
    temperature = (torch.rand(n, generator=g) + 0.3).to(DEVICE)
    tri = _run_ce("triton", x, w, labels, tw, temperature, -0.7, chunk_size=chunk)
    ref = _run_ce("torch", x, w, labels, tw, temperature, -0.7, chunk_size=chunk)
    lp = _reference(x.cpu(), w.cpu(), labels.cpu(), temperature.cpu(), torch.ones(n), torch.zeros(n))[0]
    assert close(tri[0].cpu(), -(lp * tw.cpu().double()).sum(), 1e-6)
    assert close(tri[0], ref[0], 1e-6)
    assert rel(tri[1], ref[1]) < GRAD_TOL[dtype] / 4 and rel(tri[2], ref[2]) < GRAD_TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_triton_policy_loss_matches_torch_backend(shape, dtype, entropy_coef, route):
    """The policy loss (with and without the entropy term) on Triton against torch's, by
    either route (the terms and their derivatives in the row kernel, or in the per-token
    kernel after the statistics pass)."""
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

    n, h, v = shape
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    labels = labels.to(DEVICE)
    cfg = PolicyLoss(clip_high=0.28, dual_clip=3.0, entropy_coef=entropy_coef)
    lp = linear_logprob_entropy(x, w, labels, temperature=0.8, backend="torch").logprob
    inputs = {"old_logprobs": lp + 0.3 * (torch.rand(n, generator=g).to(DEVICE) - 0.5),
              "advantages": torch.randn(n, generator=g).to(DEVICE)}
    tw = torch.rand(n, generator=g).to(DEVICE) / n

    def run(backend):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs,
                               temperature=0.8, backend=backend)
        r.loss.backward()
        return r, xr.grad, wr.grad

    tri, ref = run("triton"), run("torch")
    assert close(tri[0].loss.detach(), ref[0].loss.detach(), 1e-6)
    assert close(tri[0].logprob, ref[0].logprob, 1e-6) and close(tri[0].entropy, ref[0].entropy, 1e-6)
    assert rel(tri[1], ref[1]) < GRAD_TOL[dtype] / 4 and rel(tri[2], ref[2]) < GRAD_TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "vocab-chunks"])
def test_triton_adds_the_weight_gradient_into_an_accumulator(dtype, chunked, monkeypatch):
    """The backward's dW added into a float32 accumulator (Megatron's main_grad) equals the dW
    it returns otherwise, to the latter's rounding to the input dtype, and dX is the same bits;
    also when a small memory budget cuts the vocabulary into chunks (of one segment here)."""
    n, h, v = (1024, 256, 5003) if ON_GPU else (300, 32, 1100)
    if chunked:
        monkeypatch.setattr(triton_fused, "_BWD_CHUNK_BYTES", n * triton_fused.dx_segment(v) * 2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)

    def run(**kw):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = linear_logprob_entropy(xr, wr, labels, temperature=0.9, backend="triton", **kw)
        (r.logprob.sum() * 0.5 + r.entropy.sum()).backward()
        return xr.grad, wr.grad

    dx, dw = run()
    acc = torch.ones(v, h, device=DEVICE)
    dx2, none = run(weight_grad_accumulator=acc)
    assert none is None
    assert torch.equal(dx2, dx)  # the same chunks and products: where dW goes changes nothing
    assert rel(acc - 1, dw) < GRAD_TOL[dtype] / 8


def _eager_call_inputs(seed: int):
    """``(x, w, labels, g1, g2)`` of the eager-path tests: every seventh label ignored, the
    labels on the CPU (to be edited, then moved), the upstream gradients on ``DEVICE``."""
    n, h, v = (700, 256, 5003) if ON_GPU else (70, 32, 300)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[0])
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, DTYPES[0])
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    g1, g2 = (torch.randn(n, generator=g).to(DEVICE) for _ in range(2))
    return x, w, labels, g1, g2


def _assert_same_bits(ours: list, theirs: list) -> None:
    """Two runs' outputs and gradients: None in the same places, else the same shape, strides
    and bits."""
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and a.stride() == b.stride()
            assert a.requires_grad == b.requires_grad and torch.equal(a, b)


@pytest.mark.parametrize("case", ["plain", "entropy only", "log-prob only", "weight only",
                                  "hidden only", "main_grad", "main_grad placeholder", "no grad",
                                  "retained graph", "compiled autograd"])
@pytest.mark.slow
def test_the_one_rank_eager_function_is_the_op(case, monkeypatch):
    """On one rank, eager, the log-prob pass runs under its own autograd Function
    (``stats_op._OneRank``) instead of the op's generic eager Function (``dispatch._Eager``):
    the same results and gradients, bit for bit, for every input that needs a gradient, where
    the weight's goes, an output without a gradient, a second backward, and a backward traced
    by compiled autograd (which takes the op there). The generic path is forced here by the
    branch's own test of whether the call is traced."""
    from mcore_hooks.kernels.passes import stats_op

    x, w, labels, g1, g2 = _eager_call_inputs(21)
    v, h = w.shape
    labels = labels.to(DEVICE)

    def run():
        xr = x.clone().requires_grad_(case not in ("weight only", "no grad"))
        wr = w.clone().requires_grad_(case not in ("hidden only", "no grad"))
        acc = torch.ones(v, h, device=DEVICE) if case.startswith("main_grad") else None
        r = linear_logprob_entropy(
            xr, wr, None if case == "entropy only" else labels, temperature=0.8, backend="triton",
            weight_grad_accumulator=acc, placeholder_weight_grad=case == "main_grad placeholder")
        out = [r.entropy, r.logz] + ([] if case == "entropy only" else [r.logprob, r.label_is_argmax])
        node = type(r.entropy.grad_fn).__name__
        if case != "no grad":
            loss = r.logprob @ g1 if case == "log-prob only" else r.entropy @ g2 + (
                0 if r.logprob is None else r.logprob @ g1)
            if case == "compiled autograd":
                from torch._dynamo import compiled_autograd

                with compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward(retain_graph=case == "retained graph")
            if case == "retained graph":
                loss.backward()
        return out + [xr.grad, wr.grad, acc], node

    ours, node = run()
    monkeypatch.setattr(stats_op, "tracing", lambda: True)  # the generic eager Function
    theirs, their_node = run()
    if case != "no grad":
        assert (node, their_node) == ("_OneRankBackward", "_EagerBackward")
    _assert_same_bits(ours, theirs)
    if case == "main_grad placeholder":  # the weight's hooks ran on a zero gradient
        assert not ours[-2].any()


@pytest.mark.parametrize("case", ["gradients", "no grad", "labels outside the vocabulary",
                                  "logit scale", "ignored only", "int temperature",
                                  "vocab start"])
@pytest.mark.slow
def test_the_prologue_folded_into_the_statistics_pass_is_the_prologue(case, monkeypatch):
    """The log-prob pass with its per-token inputs formed by the statistics kernel (a scalar
    coefficient) and its merge (validity, coefficient, local rows), instead of the prologue's
    own launch: the same results, flags and gradients, bit for bit; NaN at a label outside the
    vocabulary either way (values unchecked, as on CUDA)."""
    import mcore_hooks.kernels as K
    from mcore_hooks.kernels.common.debug import debug_checks

    x, w, labels, g1, g2 = _eager_call_inputs(23)
    n, v = x.shape[0], w.shape[0]
    labels[1], labels[2] = 0, v - 1
    if case == "labels outside the vocabulary":
        labels[3], labels[5] = v, -3
    if case == "ignored only":
        labels[:] = -100
    labels = labels.to(DEVICE)
    seen = []
    real = K._prepare

    def run(fold):
        def prepare(*a, **kw):
            p = real(*a, **dict(kw, fold_prologue=fold and kw.get("fold_prologue", False)))
            seen.append(p.prologue is not None)
            return p

        monkeypatch.setattr(K, "_prepare", prepare)
        xr = x.clone().requires_grad_(case != "no grad")
        wr = w.clone().requires_grad_(case != "no grad")
        with debug_checks(False):
            r = linear_logprob_entropy(
                xr, wr, labels, temperature=2 if case == "int temperature" else 0.7,
                backend="triton", logit_scale=0.37 if case == "logit scale" else 1.0,
                parallel=VocabParallel(vocab_start=40 if case == "vocab start" else 0))
        if case != "no grad":
            (r.logprob @ g1 + r.entropy @ g2).backward()
        return [r.logprob, r.entropy, r.logz, r.label_is_argmax, xr.grad, wr.grad]

    folded, unfolded = run(True), run(False)
    assert seen == [True, False]
    for a, b in zip(folded, unfolded):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    if case == "labels outside the vocabulary":  # NaN at those tokens alone, never a number
        bad = torch.zeros(n, dtype=torch.bool, device=labels.device)
        bad[[3, 5]] = True
        for t in (folded[0], folded[1], folded[2], folded[4]):
            nan = t.isnan() if t.dim() == 1 else t.isnan().any(dim=1)
            assert torch.equal(nan, bad)
        assert not folded[3][bad].any()


@pytest.mark.parametrize("case", ["policy", "cross entropy", "entropy bonus", "k3 penalty",
                                  "temperature per token", "not batch invariant", "weight only",
                                  "hidden only", "main_grad", "main_grad placeholder", "chunks",
                                  "cross entropy main_grad chunks", "retained graph",
                                  "compiled autograd", "double backward", "declared upstream"])
@pytest.mark.slow
def test_the_one_rank_fused_loss_function_is_the_op(case, monkeypatch):
    """On one rank, eager, a fused loss with its gradients formed in the forward runs under its
    own autograd Function (``loss_op._OneRankLoss``) instead of the op's generic eager Function
    (``dispatch._Eager``): the same loss, per-token values and gradients, bit for bit, for the
    policy loss (with an entropy bonus, a k3 penalty, a temperature per token, without batch
    invariance) and the NLL, an input without a gradient, main_grad (the kept logit gradient
    or a float32 dW added in the backward, over several chunks too), several chunks, a second
    backward, a backward traced by compiled autograd, and a double backward refused by both; a
    declared upstream gradient keeps its own Function in both. The generic path is forced by
    the branch's own test."""
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss
    from mcore_hooks.kernels.passes import loss_op

    x, w, labels, g1, _ = _eager_call_inputs(25)
    v, h = w.shape
    n = x.shape[0]
    labels = labels.to(DEVICE)
    kl = dict(kl_coef=0.05, kl_type="k3") if case == "k3 penalty" else {}
    cfg = PolicyLoss(clip_high=0.28, dual_clip=3.0, entropy_coef=0.01 if case == "entropy bonus" else 0.0,
                     **kl)
    inputs = {"old_logprobs": -g1.abs(), "advantages": torch.linspace(-1, 1, n, device=DEVICE)}
    if kl:
        inputs["ref_logprobs"] = -g1.abs().flip(0)
    tw = torch.full((n,), 1.0 / n, device=DEVICE)
    temperature = torch.linspace(0.6, 1.2, n, device=DEVICE) if case == "temperature per token" else 0.8

    def run():
        xr = x.clone().requires_grad_(case != "weight only")
        wr = w.clone().requires_grad_(case != "hidden only")
        acc = torch.ones(v, h, device=DEVICE) if "main_grad" in case or case == "declared upstream" else None
        kw = dict(temperature=temperature, backend="triton", weight_grad_accumulator=acc,
                  placeholder_weight_grad=case == "main_grad placeholder",
                  chunk_size=n // 3 if "chunks" in case else None,
                  batch_invariant=case != "not batch invariant")
        if case == "declared upstream":
            kw["upstream_grad"] = 1.0
        if case.startswith("cross entropy"):
            loss, out = linear_cross_entropy(xr, wr, labels, **kw), []
        else:
            r = linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs, **kw)
            loss, out = r.loss, [r.logprob, r.entropy]
        node = type(loss.grad_fn).__name__
        if case == "compiled autograd":
            from torch._dynamo import compiled_autograd

            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        elif case == "double backward":
            gx, = torch.autograd.grad(loss, xr, create_graph=True)
            with pytest.raises(RuntimeError, match="cannot be differentiated again"):
                torch.autograd.grad(gx.float().square().sum(), xr)
            return [loss.detach(), gx.detach()], node
        else:
            loss.backward(retain_graph=case == "retained graph")
            if case == "retained graph":
                loss.backward()
        return [loss.detach()] + out + [xr.grad, wr.grad, acc], node

    ours, node = run()
    monkeypatch.setattr(loss_op, "_eager_one_rank", lambda p: False)  # the generic eager Function
    theirs, their_node = run()
    expected = ("_FusedIntoAccumulatorBackward",) * 2 if case == "declared upstream" else \
        ("_OneRankLossBackward", "_EagerBackward")
    assert (node, their_node) == expected
    _assert_same_bits(ours, theirs)
    if case == "main_grad placeholder":  # the weight's hooks ran on a zero gradient
        assert not ours[-2].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.slow
def test_the_backwards_vocabulary_chunks_leave_dx_the_same_bits(dtype, monkeypatch):
    """dX's sum over the vocabulary runs tile after tile in one order however the memory budget
    cuts the vocabulary into chunks (a float32 partial sum carried between them): one chunk,
    chunks of one and two of the product's segments give a token the same bits, and so do
    calls of other sizes (whose chunks differ at a given budget)."""
    n, h, v = (700, 256, 5003) if ON_GPU else (70, 32, 1100)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    runs = []
    seg = triton_fused.dx_segment(v)  # chunks are whole segments: of one and of two
    for budget in (None, n * seg * 2, n * 2 * seg * 2):
        if budget is not None:
            monkeypatch.setattr(triton_fused, "_BWD_CHUNK_BYTES", budget)
        runs.append(_run("triton", x, w, labels, 0.8, ones, ones * 0.5)[2])
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # the first 9 tokens alone: at this budget their chunks are wider (the budget over fewer rows)
    alone = _run("triton", x[:9], w, labels[:9], 0.8, ones[:9], ones[:9] * 0.5)[2]
    assert torch.equal(alone, runs[0][:9])
    # and the product's two forms (a program adding its tile's segments, or a program per
    # segment and a merge) give the same bits, in one chunk and carried over chunks of two
    # segments (a chunk of one segment has nothing to split)
    for budget in (1 << 40, n * 2 * seg * 2):
        monkeypatch.setattr(triton_fused, "_BWD_CHUNK_BYTES", budget)
        for split in (0, 1 << 40):
            monkeypatch.setattr(triton_fused, "_DX_SPLIT_BYTES", split)
            assert torch.equal(_run("triton", x, w, labels, 0.8, ones, ones * 0.5)[2], runs[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.slow
def test_triton_fused_loss_adds_a_declared_upstream_gradient_in_the_forward(dtype, route):
    """The policy loss with ``upstream_grad``: ``upstream_grad * dW`` is in the float32
    accumulator once the forward returns (whatever the route the hidden size would choose
    without it), equal to the weight gradient the loss returns otherwise (to that one's
    rounding to the input dtype); dX as without (the same bits by the same route)."""
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

    n, h, v = (1024, 256, 5003) if ON_GPU else (300, 32, 200)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    inputs = {"old_logprobs": (-torch.rand(n, generator=g) * 6).to(DEVICE),
              "advantages": torch.randn(n, generator=g).to(DEVICE)}
    # token-sum weights: with 1 / n the weight gradient falls below fp16's normal range and the
    # fp16 reference itself loses digits (a GPU run at 1024 tokens compared at 1.1e-2 and 1.2e-2)
    tw = torch.ones(n, device=DEVICE)
    cfg = PolicyLoss(clip_high=0.28, entropy_coef=0.01)

    def forward(xr, wr, **kw):
        return linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs,
                                  temperature=0.9, backend="triton", **kw).loss

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (forward(xr, wr) * 0.25).backward()
    acc = torch.ones(v, h, device=DEVICE)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = forward(xd, wd, weight_grad_accumulator=acc, upstream_grad=0.25)
    assert rel(acc - 1, wr.grad) < GRAD_TOL[dtype] / 8  # before the backward
    (loss * 0.25).backward()
    assert wd.grad is None
    if route != "in-backward":
        assert rel(xd.grad, xr.grad) < 1e-6
    else:  # formed in the backward without the declaration: to the input dtype's rounding
        assert rel(xd.grad, xr.grad) < GRAD_TOL[dtype] / 8


def test_per_token_policy_terms_and_derivatives_match_autograd():
    """The Triton kernel's PolicyLoss terms and derivatives (written out) against autograd
    through ``PolicyLoss.__call__`` (the torch backend's): to float32 rounding, and exactly 0
    where autograd's are (clamps at and past their bounds, ties of the max and the dual clip
    splitting the gradient, ignored and weight-0 positions, NaN where an input is NaN)."""
    from mcore_hooks.kernels import PolicyLoss
    from mcore_hooks.kernels.passes import loss_op
    from mcore_hooks.kernels.common.debug import debug_checks

    g = torch.Generator().manual_seed(12)
    n = 4000
    lp = -3 * torch.rand(n, generator=g)
    ent = 4 * torch.rand(n, generator=g)
    old = lp + torch.randn(n, generator=g) * torch.tensor([0.0, 0.1, 1.0, 30.0]).repeat(n // 4)
    adv = torch.randn(n, generator=g)
    adv[::9] = 0.0  # a1 == a2: the max's tie
    ref = lp + torch.randn(n, generator=g) * 12  # k3's clamps at +-20 and +-10
    valid = torch.rand(n, generator=g) > 0.1
    w = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.1)
    old[5], adv[7] = float("nan"), float("nan")  # counted NaN inputs: NaN there
    for cfg in (PolicyLoss(), PolicyLoss(clip_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01),
                PolicyLoss(kl_coef=0.05, kl_type="k1", log_ratio_limit=5.0), None):
        data = None if cfg is None else loss_op.policy_loss_data(cfg)
        names = () if cfg is None else cfg.input_names
        ins = [{"old_logprobs": old, "advantages": adv, "ref_logprobs": ref}[k].to(DEVICE) for k in names]
        args = [t.to(DEVICE) for t in (lp, ent, valid, w)]
        with debug_checks(False):  # the NaN inputs are the point: compute, do not refuse
            got = loss_op.token_terms(*args, data, ins, "triton")
            want = loss_op.token_terms(*args, data, ins, "torch")
        # Each side is a few float32 roundings of each of the loss's parts (exp's last bit is
        # numpy's or torch's), which may cancel: the bound is 16 ulps of the parts' magnitudes,
        # not of the result (float64 here).
        d64 = [t.double() for t in (lp, ent, old, adv, ref, w)]
        scale = _policy_parts_magnitude(cfg, *d64)
        for a, b in zip(got, want):
            a, b = a.cpu().double(), b.cpu().double()
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a == 0, b == 0)
            ok = ~b.isnan()
            assert ((a[ok] - b[ok]).abs() <= 16 * 2.0**-24 * scale[ok]).all()


def _policy_parts_magnitude(cfg, lp, ent, old, adv, ref, w):
    """Per token, ``w`` times the sum of the magnitudes of PolicyLoss's parts and of their
    derivatives' parts (float64): the scale of float32 rounding in its terms and derivatives."""
    if cfg is None:
        return w * (lp.abs() + 1)
    ratio = (lp - old).clamp(-cfg.log_ratio_limit, cfg.log_ratio_limit).exp().nan_to_num(0.0)
    parts = adv.nan_to_num(0.0).abs() * ratio.clamp(min=1.0) * (cfg.dual_clip or 1.0)
    if cfg.kl_coef:
        d = (ref - lp).clamp(-20, 20)
        kl = (lp - ref).abs() + 1 if cfg.kl_type == "k1" else d.exp() + d.abs() + 1
        parts = parts + abs(cfg.kl_coef) * kl
    return w * (parts + abs(cfg.entropy_coef) * ent)


def test_triton_is_deterministic():
    n, h, v = (2048, 256, 5003) if ON_GPU else (40, 32, 130)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[0])
    w = torch.randn(v, h, generator=g).to(DEVICE, DTYPES[0])
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    a = _run("triton", x, w, labels, 1.0, ones, ones)
    b = _run("triton", x, w, labels, 1.0, ones, ones)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.slow
def test_upstream_gradients_are_read_as_autograd_gives_them(backend):
    """The backward reads the outputs' gradients as they come: broadcast (a sum's, stride 0),
    None for an unused entropy, NaN at ignored tokens (never read there). Each form gives the
    bits of the dense gradient with 1 at every counted token and the entropy's 0."""
    n, h, v = (300, 256, 5003) if ON_GPU else (40, 32, 130)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[0])
    w0 = torch.randn(v, h, generator=g).to(DEVICE, DTYPES[0])
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    labels[::7] = -100
    ones = torch.ones(n, device=DEVICE)
    with_nan = torch.where(labels == -100, torch.nan, ones)

    def grads(loss_of):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        r = linear_logprob_entropy(x, w, labels, backend=backend)
        loss_of(r).backward()
        return x.grad, w.grad

    want = grads(lambda r: (r.logprob * ones + r.entropy * torch.zeros(n, device=DEVICE)).sum())
    for form in (lambda r: r.logprob.sum(),  # broadcast, no entropy gradient
                 lambda r: (r.logprob * ones).sum(),  # dense, no entropy gradient
                 lambda r: (r.logprob * with_nan).sum(),  # NaN at the ignored tokens
                 lambda r: (r.logprob * ones + r.entropy * (with_nan - ones)).sum()):  # both, NaN there
        for got, ref in zip(grads(form), want):
            assert torch.equal(got, ref)


@pytest.mark.parametrize("count", [None, 32])  # the shipped count (one-tile segments at these
# vocabularies); fewer, of several tiles each
@pytest.mark.slow
def test_a_tokens_statistics_do_not_depend_on_the_call(monkeypatch, count):
    """No mode asked for: a token's log-prob and entropy are the same bits alone, first in a call
    or after others, across the statistics kernel's launches (one per ``_FWD_GROUP`` tokens),
    and however many segments one program walks (the number of tokens sets that). (dX rows:
    tests/test_gpu.py, where cuBLAS forms them; a CPU BLAS may not.)"""
    monkeypatch.setattr(triton_fused, "_FWD_GROUP", 128)
    if count is not None:
        monkeypatch.setattr(triton_fused, "_SEGMENTS", count)
    # on GPU the 3000-token calls load by descriptors, the 7-token ones by pointers
    monkeypatch.setattr(triton_fused, "_TMA_MIN_WORK", 1 << 30)
    n, h, v = (3000, 256, 32003) if ON_GPU else (300, 32, 40 * 256 + 7)
    seg_tiles, segments = triton_fused.vocab_segments(math.ceil(v / triton_tiles.TILES[0].fwd.block_v))
    assert segments > 4 and (seg_tiles > 1 if count == 32 else seg_tiles == 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[0])
    w = (torch.randn(v, h, generator=g) / h**0.5).to(DEVICE, DTYPES[0])
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    probe = torch.arange(5, 12, device=DEVICE)

    def stats(rows):
        with torch.no_grad():
            r = linear_logprob_entropy(x[rows], w, labels[rows], backend="triton")
        return r.logprob, r.entropy

    alone = stats(probe)
    everything = stats(torch.arange(n, device=DEVICE))
    rest = torch.arange(n, device=DEVICE)
    rest = rest[(rest < 5) | (rest >= 12)]
    moved = stats(torch.cat([rest[:125], probe, rest[125:]]))  # across the launches' edge at 128
    for a, b, c in zip(alone, everything, moved):
        assert torch.equal(a, b[5:12]) and torch.equal(a, c[125:132])
    for splits in (1, 3, segments):  # 1 to all segments a program, a short last split
        monkeypatch.setattr(triton_fused, "forward_splits", lambda *_, s=splits: s)
        assert all(torch.equal(a, b) for a, b in zip(alone, stats(probe)))


@pytest.mark.parametrize("v", [301, 320])  # a masked vocabulary tail; whole steps (sm_90: boxes)
@pytest.mark.parametrize("family", [t.name for t in triton_tiles.TILES])
@pytest.mark.slow
def test_the_fused_losses_products_do_not_depend_on_the_call(family, v):
    """The fused losses' logits ``x @ W.T`` and ``dX = dz @ W`` (every family's tiles): a row is
    the same bits alone, first, or after others across a row block's edge, in calls of 7 to n
    rows (several row and column blocks), and within float32 summation's bound of float64."""
    backend = triton_fused.TritonFused(next(t for t in triton_tiles.TILES if t.name == family))
    # row blocks of 128: 20 (GPU: two full groups of 8 and a short one), 9 (one and a short)
    n, h = (2500, 520) if ON_GPU else (1100, 264)
    g = torch.Generator().manual_seed(v)
    dz = (torch.randn(n, v, generator=g) * 1e-2).to(DEVICE, DTYPES[0])
    x = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[0])
    w = (torch.randn(v, h, generator=g) / h**0.5).to(DEVICE, DTYPES[0])
    probe = torch.arange(5, 12, device=DEVICE)
    rest = torch.arange(n, device=DEVICE)
    rest = rest[(rest < 5) | (rest >= 12)]
    for a, b, product in ((dz, w, backend.hidden_grad), (x, w.t(), backend.logits)):
        def rows(r):  # the backend takes the weight [V, H] either way
            out = torch.empty((len(r), b.shape[1]), dtype=torch.float32, device=DEVICE)
            return product(a[r], w, out)

        alone, whole = rows(probe), rows(torch.arange(n, device=DEVICE))
        moved = rows(torch.cat([rest[:125], probe, rest[125:]]))  # rows 125-131: across 128
        assert torch.equal(alone, whole[5:12]) and torch.equal(alone, moved[125:132])
        # Each entry sums products of 16-bit numbers (exact in float32) in float32: within
        # gamma_K ~ K * u of the sum of the terms' magnitudes (Higham, first order), u = 2^-24
        # rounding to nearest; 2^-23 as tensor cores truncate in their accumulation (Fasi et
        # al. 2021).
        ref = a.double() @ b.double()
        bound = a.shape[1] * 2.0**-23 * (a.double().abs() @ b.double().abs())
        assert ((whole.double() - ref).abs() <= bound).all()


def test_backend_choice():
    x = torch.randn(4, 8, device=DEVICE)
    w = torch.randn(16, 8, device=DEVICE)
    with pytest.raises(ValueError, match="backend: 'triton' needs bf16/fp16"):
        linear_logprob_entropy(x, w, backend="triton")
    from mcore_hooks.kernels import backend_for

    assert backend_for(torch.float16, DEVICE).startswith("triton (sm_" if ON_GPU else "torch")
    assert backend_for(torch.float32, DEVICE) == "torch"  # fp32: exact torch matmuls
    assert backend_for(torch.float16, DEVICE, "torch") == "torch"


@pytest.mark.parametrize("family", [t.name for t in triton_tiles.TILES])
def test_every_gpu_familys_tiles_compute_the_same(family, monkeypatch):
    """Each family's tile shapes (forced here, whatever the GPU) against float64: the smaller
    tiles chosen for sm_80 and sm_86/89 are checked on any GPU this runs on (and under the
    interpreter), their fit in those GPUs' shared memory by the selection test."""
    tiles = next(t for t in triton_tiles.TILES if t.name == family)
    monkeypatch.setattr(triton_tiles, "device_tiles", lambda device: tiles)
    n, h, v = 37, 72, 301  # nothing divisible by the tiles
    g = torch.Generator().manual_seed(7)
    dtype = DTYPES[-1]
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    temperature = (torch.rand(n, generator=g) + 0.3).to(DEVICE)
    g1, g2 = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    got = _run("triton", x, w, labels, temperature, g1, g2)
    ref = _reference(x, w, labels, temperature, g1, g2)
    assert close(got[0], ref[0], 2e-6) and close(got[1], ref[1], 2e-6)
    assert rel(got[2], ref[2]) < GRAD_TOL[dtype] and rel(got[3], ref[3]) < GRAD_TOL[dtype]


class _TpCase(NamedTuple):
    group: object
    rank: int
    dev: str
    g: torch.Generator
    n: int
    v_rank: int
    x: torch.Tensor
    w: torch.Tensor
    labels: torch.Tensor

    def shards(self, world: int, sp: bool) -> tuple[slice, slice]:
        """This rank's token rows (under SP) and vocab rows."""
        tokens = slice(self.rank * self.n // world, (self.rank + 1) * self.n // world) if sp else slice(None)
        return tokens, slice(self.rank * self.v_rank, (self.rank + 1) * self.v_rank)


def _tp_case(world: int, seed: int) -> _TpCase:
    """The same full inputs on every rank (each takes its shards), labels at shard edges."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    dev = "cpu"
    if ON_GPU:  # ranks share the GPUs there are (gloo takes CUDA tensors): TP=2 runs on one GPU
        dev = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(seed)
    n, h, v_rank = 16 * world, 48, 67
    dtype = DTYPES[-1]
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v_rank * world, h, generator=g) / math.sqrt(h)).to(dtype)
    labels = torch.randint(0, v_rank * world, (n,), generator=g)
    labels[:world] = torch.arange(world) * v_rank + v_rank - 1  # last id of each shard
    return _TpCase(group, rank, dev, g, n, v_rank, x, w, labels)


def _tp_triton(world):
    c = _tp_case(world, seed=3)
    g1, g2 = torch.randn(c.n, generator=c.g), torch.randn(c.n, generator=c.g)
    ref = _reference(c.x, c.w, c.labels, 0.9, g1, g2)
    out = []
    for sp in (False, True):
        tokens, shard = c.shards(world, sp)
        got = _run(
            "triton", c.x[tokens].to(c.dev), c.w[shard].to(c.dev), c.labels.to(c.dev), 0.9,
            g1.to(c.dev), g2.to(c.dev), parallel=VocabParallel(c.group, c.rank * c.v_rank, sp),
        )
        out.append((rel(got[0].cpu(), ref[0]), rel(got[1].cpu(), ref[1]),
                    rel(got[2].cpu(), ref[2][tokens]), rel(got[3].cpu(), ref[3][shard])))
    return out


def _tp_triton_ce(world):
    c = _tp_case(world, seed=4)
    tw = torch.rand(c.n, generator=c.g)
    full = _run_ce("torch", c.x, c.w, c.labels, tw, 0.9, 1.3, chunk_size=7)  # one rank, whole vocab
    out = []
    for sp in (False, True):
        tokens, shard = c.shards(world, sp)
        got = _run_ce(
            "triton", c.x[tokens].to(c.dev), c.w[shard].to(c.dev), c.labels.to(c.dev), tw.to(c.dev),
            0.9, 1.3, chunk_size=7, parallel=VocabParallel(c.group, c.rank * c.v_rank, sp),
        )
        out.append((abs(float(got[0]) / float(full[0]) - 1), rel(got[1].cpu(), full[1][tokens]),
                    rel(got[2].cpu(), full[2][shard])))
    return out


def test_triton_cross_entropy_vocab_parallel_2_ranks():
    for rank_rows in run_on_ranks(_tp_triton_ce, 2, 2):
        for loss, dx, dw in rank_rows:
            assert loss < 1e-6 and dx < GRAD_TOL[DTYPES[-1]] / 4 and dw < GRAD_TOL[DTYPES[-1]] / 4


def test_triton_vocab_parallel_2_ranks():
    for rank_rows in run_on_ranks(_tp_triton, 2, 2):
        for lp, ent, dx, dw in rank_rows:
            assert lp < 2e-6 and ent < 2e-6 and dx < GRAD_TOL[DTYPES[-1]] and dw < GRAD_TOL[DTYPES[-1]]


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.slow
def test_tensor_descriptor_loads_match_pointer_loads(shape, monkeypatch):
    """The TMA (tensor-descriptor) tile loads give the same bits as the pointer loads (the
    loads differ, not the products' order)."""
    from mcore_hooks.kernels.triton_backend import triton_fused

    if triton_fused.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    n, h, v = shape
    g = torch.Generator().manual_seed(1)
    dtype = DTYPES[-1]
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    temperature = (torch.rand(n, generator=g) + 0.3).to(DEVICE)
    g1, g2 = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    results = {}
    monkeypatch.setattr(triton_fused, "_TMA_MIN_WORK", 0)  # descriptors at any size
    for tma in (False, True):
        monkeypatch.setattr(triton_fused, "_USE_TMA", tma)
        # the tiles' own setting (sm_90's on GPU and under the interpreter) and aligned inputs
        assert triton_fused._operands(x, w, triton_tiles.TILES[0].fwd, True)[2] is tma
        results[tma] = _run("triton", x, w, labels, temperature, g1, g2)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def test_small_products_load_by_pointers():
    """Descriptors only for products of at least ``_TMA_MIN_WORK`` multiply-adds (below, their
    host time is more than the GPU time they save); aligned operands either way."""
    from mcore_hooks.kernels.triton_backend import triton_fused

    if triton_fused.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    tile = triton_tiles.TILES[0]
    x = torch.zeros(256, 128, dtype=DTYPES[-1], device=DEVICE)
    w = torch.zeros(512, 128, dtype=DTYPES[-1], device=DEVICE)
    dz = torch.zeros(256, 512, dtype=DTYPES[-1], device=DEVICE)
    work = 256 * 512 * 128  # x @ w.T and dz @ w alike
    for least, want in ((work + 1, False), (work, True)):
        triton_fused._TMA_MIN_WORK, old = least, triton_fused._TMA_MIN_WORK
        try:
            assert triton_fused._operands(x, w, tile.fwd, True)[2] is want
            assert triton_fused._product_operands(dz, w, tile.dx, True)[2] is want
        finally:
            triton_fused._TMA_MIN_WORK = old


@triton.jit
def _axpy_kernel(x, y, out, a, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) * a + tl.load(y + i, mask=m), mask=m)


def test_direct_launches_run_tritons_own_compiled_kernels(monkeypatch):
    """:class:`~mcore_hooks.kernels.triton_backend.launch.FastLaunch` launches Triton's own compiled kernels: on
    GPU, a launch goes through Triton's ``run`` only for a specialization Triton has not compiled
    (a length of 1 or a multiple of 16, a pointer off 16-byte alignment: one compiled kernel each
    in Triton's cache) and otherwise calls the kernel Triton cached, giving the same results;
    while a launch hook is installed every launch is Triton's (the hook called). Under the
    interpreter every launch is Triton's."""
    from triton import knobs

    from mcore_hooks.kernels.triton_backend.launch import FastLaunch

    runs = []
    tritons_run = _axpy_kernel.run
    monkeypatch.setattr(_axpy_kernel, "run", lambda *a, **kw: runs.append(1) or tritons_run(*a, **kw))
    k = FastLaunch(_axpy_kernel)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 1004, generator=g).to(DEVICE)
    # (1000, 4) and the last (1000, 0): the first's kernel (other pointers, aligned too)
    launches = ((1000, 0), (1000, 0), (1, 0), (992, 0), (999, 1), (1000, 4), (1000, 0))
    for n, off in launches:
        x, y = base[0, off:off + n], base[1, off:off + n]
        out = torch.empty(n, device=DEVICE)
        k[(triton.cdiv(n, 128),)](x, y, out, 0.5, n, BLOCK=128)
        assert torch.equal(out, x * 0.5 + y)  # x * 0.5 exact: no rounding for a fused multiply-add
    assert k._direct is ON_GPU
    if ON_GPU:  # Triton's run for the first launch and the three new specializations only
        assert len(runs) == 4
        assert len(_axpy_kernel.device_caches[torch.cuda.current_device()][0]) == 4
    else:
        assert len(runs) == len(launches)

    if getattr(knobs, "HookChain", None) is None:
        pytest.skip("this Triton's launch hooks are plain callables")
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = torch.empty(1000, device=DEVICE)
        k[(8,)](base[0, :1000], base[1, :1000], out, 0.5, 1000, BLOCK=128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert torch.equal(out, base[0, :1000] * 0.5 + base[1, :1000])
    assert len(runs) == (5 if ON_GPU else len(launches) + 1)
    if ON_GPU:  # (the interpreter calls no launch hooks)
        assert len(seen) == 1


def test_misaligned_views_fall_back_to_pointer_loads(monkeypatch):
    """A weight view starting mid-allocation (not 16-byte aligned) still computes correctly."""
    from mcore_hooks.kernels.triton_backend import triton_fused

    monkeypatch.setattr(triton_fused, "_TMA_MIN_WORK", 0)  # not by size: by alignment

    dtype = DTYPES[-1]
    n, h, v = 9, 64, 37
    g = torch.Generator().manual_seed(2)
    backing = (torch.randn(v * h + 1, generator=g) / 8).to(DEVICE, dtype)
    w = backing[1:].view(v, h)  # 2-byte offset
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    assert triton_fused._operands(x, w, triton_tiles.TILES[0].fwd, True)[2] is False
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    tri = _run("triton", x, w, labels, 1.0, ones, ones)
    ref = _reference(x, w, labels, 1.0, ones, ones)
    assert close(tri[0], ref[0], 1e-5) and close(tri[1], ref[1], 1e-5)


# --------------------------------------------------------------------------- tiles of other GPUs


def _compiled_shared_memory(kernel, signature: dict, flags: dict, capability: int, tile) -> int:
    """Shared memory of ``kernel`` compiled for a GPU of this compute capability (Triton
    cross-compiles; nothing runs, no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = tile.launch()
    options = dict(num_warps=launch.pop("num_warps"), num_stages=launch.pop("num_stages"))
    constexprs = dict(flags, **launch)
    signature = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options).metadata.shared


def _shared_memory_report(family: str, capability: int) -> list[int]:
    tiles = next(t for t in triton_tiles.TILES if t.name == family)
    ptr = {"X": "*bf16", "W": "*bf16", "COEF": "*fp32"}
    fwd = dict(ptr, M="*fp32", S="*fp32", A="*fp32", N="i32", V="i32", H="i32", stride_x="i32",
               stride_w="i32", stride_p="i32", seg_tiles="i32", segments="i32", segs_per_split="i32", splits="i32",
               group="i32", coef_scalar="fp32")
    bwd = dict(ptr, LABEL="*i64", VALID="*i1", M="*fp32", LOGS="*fp32", ENT="*fp32", G1="*fp32",
               G2="*fp32", DZ="*bf16", N="i32", V="i32", H="i32", v0="i32", Vc="i32", stride_x="i32",
               stride_w="i32", stride_dz="i32", stride_g1="i32", stride_g2="i32")
    logits = dict(X="*bf16", W="*bf16", Z="*fp32", N="i32", V="i32", H="i32", stride_x="i32",
                  stride_w="i32", stride_z="i32")
    dx = dict(DZ="*bf16", W="*bf16", ACC="*fp32", OUT="*bf16", PARTS="*fp32", N="i32", H="i32",
              V="i32", seg_cols="i32", segments="i32", stride_dz="i32", stride_w="i32", stride_o="i32")
    flags = dict(EVEN_K=True, USE_TMA=False)
    return [
        _compiled_shared_memory(triton_kernels._stats_fwd_kernel, fwd, dict(flags, SCALAR_COEF=False),
                                capability, tiles.fwd),
        _compiled_shared_memory(triton_kernels._stats_fwd_kernel, fwd, dict(flags, SCALAR_COEF=True),
                                capability, tiles.fwd),
        _compiled_shared_memory(triton_kernels._dlogits_kernel, bwd,
                                dict(flags, GROUP=triton_fused._DZ_GROUP, HAS_G1=True, HAS_G2=True),
                                capability, tiles.bwd),
        _compiled_shared_memory(triton_losses._logits_kernel, logits, flags, capability, tiles.fwd),
    ] + [
        _compiled_shared_memory(triton_kernels._hidden_grad_kernel, dx,
                                dict(USE_TMA=False, GROUP=triton_fused._DX_GROUP, SPLIT=split,
                                     CONTINUE=True), capability, tiles.dx)
        for split in (False, True)  # a program per tile, and per (tile, segment)
    ]


@pytest.mark.parametrize(
    "family, capability, limit",
    [("sm_80", 80, 163 * 1024), ("sm_86", 86, 99 * 1024), ("sm_86", 89, 99 * 1024),
     ("sm_86", 120, 99 * 1024)],
)
@pytest.mark.slow
def test_each_familys_tiles_fit_that_gpu(family, capability, limit):
    """The tiles chosen for GPUs this project has no access to, compiled for them: their
    kernels need no more shared memory than the selection's estimate, which fits the GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    run = subprocess.run(
        [sys.executable, __file__, family, str(capability)], capture_output=True, text=True,
        timeout=300, env=env,
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("this Triton cannot compile for CUDA here (no ptxas)")
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    tiles = next(t for t in triton_tiles.TILES if t.name == family)
    assert max(used) <= tiles.shared_memory() <= limit, (used, tiles.shared_memory(), limit)


if __name__ == "__main__":  # the subprocess of the test above
    print(json.dumps(_shared_memory_report(sys.argv[1], int(sys.argv[2]))))


@pytest.mark.parametrize("per_token", [False, True])
def test_the_prologue_kernel_matches_the_torch_form(per_token):
    """The entry points' one-launch prologue (CUDA, values unchecked) against its torch form:
    the same validity, coefficients (NaN for a label outside the vocabulary and for a
    temperature not positive and finite) and local rows, on a rank of a split vocabulary."""
    from mcore_hooks.kernels.passes.arguments import _coefficients
    from mcore_hooks.kernels.common.autograd import local_labels

    g = torch.Generator().manual_seed(13)
    n, v_total, start, v_local = 3000, 1000, 250, 250
    labels = torch.randint(-3, v_total + 3, (n,), generator=g)
    labels[::5] = -100
    temp = torch.rand(n, generator=g) + 0.1
    temp[1::97], temp[2::89], temp[3::83], temp[4::79] = 0.0, float("nan"), float("inf"), -1.0
    given = temp if per_token else 0.7
    valid, coef, local = triton_fused.TritonFused.prologue(
        labels.to(DEVICE), temp.to(DEVICE) if per_token else None,
        0 if per_token else 1.5 / 0.7, 1.5, -100, v_total, start, v_local)
    want_valid = labels != -100
    bad = want_valid & ((labels < 0) | (labels >= v_total))
    from mcore_hooks.kernels.common.debug import debug_checks

    with debug_checks(False):
        want_coef = torch.where(bad, torch.nan, _coefficients(given, 1.5, n, torch.device("cpu"), want_valid))
    assert torch.equal(valid.cpu(), want_valid)
    assert torch.equal(local.cpu(), local_labels(labels, want_valid, start, v_local))
    assert torch.equal(coef.cpu().isnan(), want_coef.isnan())
    assert torch.equal(coef.cpu().nan_to_num(), want_coef.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.slow
def test_triton_fused_loss_adds_its_weight_gradient_into_an_accumulator(dtype, route):
    """The policy loss with an accumulator (Megatron's main_grad) and no declared upstream
    gradient: the backward adds ``grad * dW`` into it, by each route (dW kept in float32 or
    formed from the kept logit gradient in the backward, or the logits recomputed there), equal
    to the dW the loss returns otherwise (to that one's rounding), and dX the same bits."""
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

    n, h, v = (1024, 256, 5003) if ON_GPU else (300, 32, 200)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    inputs = {"old_logprobs": (-torch.rand(n, generator=g) * 6).to(DEVICE),
              "advantages": torch.randn(n, generator=g).to(DEVICE)}
    tw = torch.ones(n, device=DEVICE)
    cfg = PolicyLoss(clip_high=0.28, entropy_coef=0.01)

    def run(**kw):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs,
                                  temperature=0.9, backend="triton", **kw).loss
        (loss * 0.25).backward()
        return xr.grad, wr.grad

    dx, dw = run()
    acc = torch.ones(v, h, device=DEVICE)
    dx2, none = run(weight_grad_accumulator=acc)
    assert none is None
    assert torch.equal(dx2, dx)
    assert rel(acc - 1, dw) < GRAD_TOL[dtype] / 8


@pytest.mark.slow
def test_strided_per_token_inputs_are_read_as_given(route):
    """Per-token inputs given as strided views (a column of a [N, 2] tensor, an expanded
    scalar) give the same bits as contiguous copies: the kernels read a token's value at its
    index, so the entry points hand them contiguous tensors."""
    from mcore_hooks.kernels import PolicyLoss, linear_policy_loss

    n, h, v = 37, 40, 301
    g = torch.Generator().manual_seed(15)
    x = torch.randn(n, h, generator=g).to(DEVICE, DTYPES[-1])
    w = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(DEVICE, DTYPES[-1])
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    wide = torch.rand(n, 2, generator=g).to(DEVICE)
    old = -3 * torch.rand(n, 3, generator=g).to(DEVICE)
    adv = torch.randn(n, 2, generator=g).to(DEVICE)
    cfg = PolicyLoss(clip_high=0.28, entropy_coef=0.01)

    def run(tw, inputs):
        xr = x.clone().requires_grad_()
        r = linear_policy_loss(xr, w, labels, token_weight=tw, loss=cfg, inputs=inputs,
                               temperature=torch.full((1,), 0.9, device=DEVICE).expand(n),
                               backend="triton")
        r.loss.backward()
        return r.loss.detach(), r.logprob, xr.grad

    strided = run(wide[:, 1], {"old_logprobs": old[:, 2], "advantages": adv[:, 0]})
    plain = run(wide[:, 1].contiguous(), {"old_logprobs": old[:, 2].contiguous(),
                                          "advantages": adv[:, 0].contiguous()})
    assert all(torch.equal(a, b) for a, b in zip(strided, plain))
