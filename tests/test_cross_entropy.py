"""The reduced cross-entropy kernel (gradients formed in the forward) on plain tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_hooks.kernels import VocabParallel, linear_cross_entropy
from mcore_hooks.testing import run_on_ranks
from test_kernels import LargestTensor, problems, reference, rel

pytestmark = pytest.mark.release_independent


def _ours(x, w, labels, grad_out, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = linear_cross_entropy(x, w, labels, **kw)
    (loss * grad_out).backward()
    return loss, x.grad, w.grad


def _ref(x, w, labels, grad_out, token_weight=None, temperature=1.0, scale=1.0):
    """float64 loss and gradients. For bf16/fp16 inputs the logit gradient is rounded to the
    input dtype before the two matmuls, as in the kernel (and in stock, whose logits are already
    rounded): that rounding is the contract, the rest is exact."""
    lp, _ = reference(x, w, labels, temperature, scale)
    tw = torch.ones_like(lp) if token_weight is None else token_weight.double()
    valid = labels != -100
    loss = -(lp * tw).sum()
    t = temperature.double().unsqueeze(1) if torch.is_tensor(temperature) else float(temperature)
    xd, wd = x.double(), w.double()
    p = torch.softmax(xd @ wd.t() * scale / t, dim=-1)
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), w.shape[0]).double()
    dz = (p - onehot) * torch.where(valid, tw, 0.0).unsqueeze(1) * scale / t
    dz = dz.to(x.dtype).double()
    return loss, grad_out * dz @ wd, grad_out * dz.t() @ xd


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pb=problems(),
    weights=st.sampled_from(["none", "mask", "mean", "random"]),
    grad_out=st.sampled_from([1.0, -0.37, 8.0]),
)
def test_matches_float64_values_and_gradients(pb, weights, grad_out):
    x, w, labels, temp, scale, dtype, n, g = (
        pb.x, pb.w, pb.labels, pb.temperature, pb.scale, pb.dtype, len(pb.labels), pb.gen
    )
    tw = {
        "none": None,
        "mask": (torch.rand(n, generator=g) < 0.7).float(),
        "mean": torch.full((n,), 1.0 / n),
        "random": torch.rand(n, generator=g),
    }[weights]
    kw = dict(token_weight=tw, temperature=temp, logit_scale=scale)
    loss, dx, dw = _ours(x, w, labels, grad_out, chunk_size=pb.chunk, **kw)
    ref, rdx, rdw = _ref(x, w, labels, grad_out, tw, temp, scale)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert abs(float(loss.detach()) - float(ref)) <= 1e-5 * (1 + abs(float(ref)))
    assert dx.dtype == dtype and dw.dtype == dtype
    # Beyond the logit gradient's rounding (in the reference too): the outputs' own rounding.
    grad_tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    # p - 1[label] is formed in fp32 (as stock forms it), so each logit gradient carries an
    # absolute error of a few fp32 ulps of 1, times its weight and coefficient. Near-certain
    # predictions make the gradient itself that small: allow that much absolutely.
    coef = scale / (temp.min().item() if torch.is_tensor(temp) else temp)
    unit = 1e-6 * abs(grad_out) * coef * (1.0 if tw is None else tw.abs().max().item())
    assert (dx.double() - rdx).norm() <= grad_tol * rdx.norm() + unit * w.double().norm()
    assert (dw.double() - rdw).norm() <= grad_tol * rdw.norm() + unit * x.double().norm()
    if rdx.norm() == 0:  # every position ignored or weighted 0: exactly no gradient
        assert dx.abs().max() == 0 and dw.abs().max() == 0
    # no gradient wanted: the same value from the log-prob pass
    with torch.no_grad():
        plain = linear_cross_entropy(x, w, labels, **kw)
    assert abs(float(plain) - float(ref)) <= 1e-5 * (1 + abs(float(ref)))


def test_gradient_to_one_input_only():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 50, (20,), generator=g)
    _, rdx, rdw = _ref(x, w, labels, 1.0)
    xr = x.clone().requires_grad_()
    linear_cross_entropy(xr, w, labels, chunk_size=6).backward()
    assert rel(xr.grad, rdx) < 1e-6 and not w.requires_grad
    wr = w.clone().requires_grad_()
    linear_cross_entropy(x, wr, labels, chunk_size=6).backward()
    assert rel(wr.grad, rdw) < 1e-6


def test_bad_input_names_the_argument():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    y = torch.tensor([1, 2, 3, -100])
    with pytest.raises(ValueError, match="labels: linear_cross_entropy needs labels"):
        linear_cross_entropy(x, w, None)
    with pytest.raises(ValueError, match=r"token_weight: expected shape \(4,\)"):
        linear_cross_entropy(x, w, y, token_weight=torch.ones(3))
    with pytest.raises(TypeError, match="token_weight: expected a float tensor"):
        linear_cross_entropy(x, w, y, token_weight=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(x, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="labels: 1 id"):
        linear_cross_entropy(x, w, torch.tensor([1, 2, 3, 10]))


def test_memory_holds_one_chunk_of_logits_and_fp32_gradients():
    n, hidden, vocab, chunk = 256, 16, 1000, 8  # chunk x vocab < vocab x hidden
    x = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    with LargestTensor() as ours:
        linear_cross_entropy(x, w, y, chunk_size=chunk).backward()
    # the float32 dW accumulator is the largest: never a [tokens, vocab] tensor
    assert ours.largest <= max(chunk * vocab, vocab * hidden, n * hidden), ours.largest


def _tp_check(vocab_per_rank: int, sequence_parallel: bool):
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(17)
    n, hidden = 12 * world, 8
    vocab = vocab_per_rank * world
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[0], labels[1], labels[2], labels[3] = vocab_per_rank - 1, vocab_per_rank, vocab - 1, -100
    temp = torch.rand(n, generator=g) + 0.5
    tw = torch.rand(n, generator=g)
    ref, rdx, rdw = _ref(x, w, labels, 0.5, tw, temp)
    shard = slice(rank * vocab_per_rank, (rank + 1) * vocab_per_rank)
    tokens = slice(rank * n // world, (rank + 1) * n // world) if sequence_parallel else slice(None)
    loss, dx, dw = _ours(
        x[tokens], w[shard], labels, 0.5, token_weight=tw, temperature=temp, chunk_size=5,
        parallel=VocabParallel(group, rank * vocab_per_rank, sequence_parallel),
    )
    return abs(float(loss) - float(ref)) / abs(float(ref)), rel(dx, rdx[tokens]), rel(dw, rdw[shard])


def _tp_all(world):
    return [((v, sp), _tp_check(v, sp)) for v in (1, 13) for sp in (False, True)]


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_matches_unsplit(world):
    for rank_rows in run_on_ranks(_tp_all, world, world):
        for layout, errors in rank_rows:
            assert max(errors) < 1e-5, (layout, errors)
