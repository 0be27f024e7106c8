"""The kernel on plain tensors: exactness against float64, edge cases, bad input, memory."""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from mcore_hooks.kernels import VocabParallel, linear_logprob_entropy
from mcore_hooks.testing import run_on_ranks
from tolerances import grad_bounds, logit_grad_reference, ratio

pytestmark = pytest.mark.release_independent


def reference(x, w, labels, temperature=1.0, scale=1.0, ignore_index=-100):
    """float64 log-prob of the labels and entropy, masked like the kernel."""
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    logits = (x.double() @ w.double().t()) * scale
    logits = logits / (t.unsqueeze(1) if torch.is_tensor(t) else t)
    logp = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def rel(a, b):
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-300)).item()


def _grads(x, w, labels, g_lp, g_ent, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    r = linear_logprob_entropy(x, w, labels, **kw)
    (r.logprob * g_lp + r.entropy * g_ent).sum().backward()
    return r, x.grad, w.grad


def _ref_grads(x, w, labels, g_lp, g_ent, temperature=1.0, scale=1.0):
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    lp, ent = reference(x, w, labels, temperature, scale)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp, ent, x.grad, w.grad


class Problem(NamedTuple):
    x: torch.Tensor
    w: torch.Tensor
    labels: torch.Tensor  # -100 where ignored
    temperature: Union[float, torch.Tensor]  # a float or a per-token [N] tensor
    scale: float
    chunk: int
    dtype: torch.dtype
    gen: torch.Generator  # seeded: draw any further tensors from it


@st.composite
def problems(draw) -> Problem:
    """The kernels' property ranges: token counts, vocab sizes (primes, and 129920 / 151936 /
    248320 scaled down by 128: divisible by nothing useful), hidden sizes, chunks, temperatures
    (float or per token), ignored positions, logit scales and dtypes."""
    n = draw(st.integers(1, 48))
    vocab = draw(st.sampled_from([1, 2, 7, 97, 257, 1015, 1187, 1299, 1940]))
    hidden = draw(st.sampled_from([1, 8, 24]))
    chunk = draw(st.integers(1, 64))
    temperature = draw(st.one_of(st.floats(0.05, 5.0), st.just("per-token")))
    ignore_density = draw(st.floats(0.0, 1.0))
    scale = draw(st.sampled_from([1.0, 0.25, 3.0]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_density] = -100
    temp = torch.rand(n, generator=g) + 0.2 if temperature == "per-token" else temperature
    return Problem(x, w, labels, temp, scale, chunk, dtype, g)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pb=problems())
def test_matches_float64_values_and_gradients(pb):
    x, w, labels, temp, scale, dtype, n = (
        pb.x, pb.w, pb.labels, pb.temperature, pb.scale, pb.dtype, len(pb.labels)
    )
    g_lp, g_ent = torch.randn(n, generator=pb.gen), torch.randn(n, generator=pb.gen)
    r, dx, dw = _grads(x, w, labels, g_lp, g_ent, temperature=temp, logit_scale=scale, chunk_size=pb.chunk)
    assert r.logprob.dtype == torch.float32 and r.entropy.dtype == torch.float32
    lp, ent, rdx, rdw = _ref_grads(x, w, labels, g_lp, g_ent, temp, scale)
    assert r.logprob.dtype == torch.float32 and r.logprob.shape == (n,)
    assert (r.logprob.double() - lp).abs().max() <= 1e-5 * (1 + lp.abs().max())
    assert (r.entropy.double() - ent).abs().max() <= 1e-5 * (1 + ent.abs().max())
    assert dx.dtype == dtype and dw.dtype == dtype
    # Values keep fp32 logits whatever the input dtype; gradients go through matmuls in the
    # input dtype (as stock's do), so they carry its rounding. Bounded entry by entry by the sum
    # of |terms| of each product (tests/tolerances.py): the logit gradient's fp32 error
    # (near-certain predictions included), its rounding to the dtype (u_in |dz|), the fp32
    # accumulation (K u32 sum|terms|: K = V for dX, N for dW) and the result's rounding
    # (u_out |result|), times C = 2. A norm-relative bound fails where the terms cancel (bf16,
    # hidden 1, vocab 2: 0.0276 against 0.0159).
    ref = logit_grad_reference(x, w, labels, lambda lp_, ent_: lp_ * g_lp.double() + ent_ * g_ent.double(),
                               temp, scale)
    assert torch.allclose(ref.dx, rdx, rtol=1e-9, atol=1e-12) and torch.allclose(ref.dw, rdw, rtol=1e-9, atol=1e-12)
    bound = grad_bounds(ref, x, w, dtype)
    assert ratio(dx, ref.dx, bound.dx) <= 1, ("dx", ratio(dx, ref.dx, bound.dx))
    assert ratio(dw, ref.dw, bound.dw) <= 1, ("dw", ratio(dw, ref.dw, bound.dw))
    ignored = labels == -100
    assert torch.all(r.logprob[ignored] == 0) and torch.all(r.entropy[ignored] == 0)
    assert torch.all(dx[ignored] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["ordinary", "huge", "all-negative"])
def test_low_precision_is_at_least_as_accurate_as_stock(dtype, case):
    """bf16/fp16 inputs: logits stay fp32 in the kernel; stock rounds them to the input dtype."""
    g = torch.Generator().manual_seed(3)
    n, vocab, hidden = 64, 1031, 64
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)
    if case == "huge":
        w = w * 60.0  # logits of magnitude ~500
    if case == "all-negative":
        x = x * 0.01
        bias_dir = torch.randn(hidden, generator=g)
        x = x + bias_dir
        w = w * 0.01 - 60.0 * bias_dir / bias_dir.square().sum()  # every logit near -60
    x, w = x.to(dtype), w.to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    lp_ref, ent_ref = reference(x, w, labels)
    r = linear_logprob_entropy(x, w, labels)
    stock_logits = (x @ w.t()).float()  # what Megatron's CE sees: logits rounded to dtype
    stock_logp = torch.log_softmax(stock_logits, -1)
    stock_lp = stock_logp.gather(1, labels.unsqueeze(1)).squeeze(1)
    stock_ent = -(stock_logp.exp() * stock_logp).sum(-1)
    assert torch.isfinite(r.logprob).all() and torch.isfinite(r.entropy).all()
    assert rel(r.logprob, lp_ref) <= rel(stock_lp, lp_ref) + 1e-7
    assert rel(r.entropy, ent_ref) <= rel(stock_ent, ent_ref) + 1e-7
    assert rel(r.logprob, lp_ref) < 1e-5 and rel(r.entropy, ent_ref) < 1e-4


def test_extreme_and_equal_logits():
    n, hidden, vocab = 6, 4, 50
    x = torch.zeros(n, hidden)
    w = torch.randn(vocab, hidden)
    labels = torch.arange(n)
    r = linear_logprob_entropy(x, w, labels)  # all logits equal
    torch.testing.assert_close(r.logprob, torch.full((n,), -math.log(vocab)))
    torch.testing.assert_close(r.entropy, torch.full((n,), math.log(vocab)))
    for magnitude in (1e4, -1e4):
        x = torch.ones(n, hidden)
        w = torch.randn(vocab, hidden) + magnitude / hidden  # logits ~ +-1e4, spread ~ a few
        r = linear_logprob_entropy(x, w, labels)
        lp, ent = reference(x, w, labels)
        assert torch.isfinite(r.logprob).all() and torch.isfinite(r.entropy).all()
        assert (r.entropy >= 0).all()
        # fp32 logits of magnitude 1e4 carry ~1e-3 rounding each (one ulp); allow a few ulps
        ulp = abs(magnitude) * 2.0**-23
        torch.testing.assert_close(r.logprob.double(), lp, rtol=0, atol=16 * ulp)
        torch.testing.assert_close(r.entropy.double(), ent, rtol=0, atol=16 * ulp)
    # a one-hot distribution: entropy exactly ~0, not negative or NaN
    w = torch.zeros(vocab, hidden)
    w[3] = 1e3
    r = linear_logprob_entropy(torch.ones(2, hidden), w, torch.tensor([3, 3]))
    assert r.entropy.abs().max() < 1e-6 and r.logprob.abs().max() < 1e-6


def test_entropy_only_needs_no_labels():
    x, w = torch.randn(5, 8), torch.randn(11, 8)
    r = linear_logprob_entropy(x, w)
    assert r.logprob is None
    ref = reference(x, w, torch.zeros(5, dtype=torch.long))[1]
    torch.testing.assert_close(r.entropy, ref.float(), rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_argument():
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    cases = [
        (dict(labels=torch.randint(0, 16, (5,))), ValueError, "labels: expected shape"),
        (dict(labels=torch.tensor([0, 1, 2, 16])), ValueError, "labels: 1 id"),
        (dict(labels=torch.tensor([0, -5, 2, 3])), ValueError, "labels: 1 id"),
        (dict(labels=y.float()), TypeError, "labels: expected an integer"),
        (dict(labels=y, ignore_index=3), ValueError, "ignore_index: 3 is a vocabulary id"),
        (dict(labels=y, temperature=0.0), ValueError, "temperature"),
        (dict(labels=y, temperature=-1.0), ValueError, "temperature"),
        (dict(labels=y, temperature=float("nan")), ValueError, "temperature"),
        (dict(labels=y, temperature=torch.tensor([1.0, 1.0, 0.0, 1.0])), ValueError, "temperature"),
        (dict(labels=y, temperature=torch.ones(3)), ValueError, "temperature"),
        (dict(labels=y, chunk_size=0), ValueError, "chunk_size"),
        (dict(labels=y, backend="cuda-magic"), ValueError, "backend"),
        (dict(labels=y, logit_scale=float("inf")), ValueError, "logit_scale"),
    ]
    for kwargs, err, msg in cases:
        with pytest.raises(err, match=msg):
            linear_logprob_entropy(x, w, **kwargs)
    with pytest.raises(ValueError, match="hidden: hidden size 8 does not match weight's 9"):
        linear_logprob_entropy(x, torch.randn(16, 9), y)
    with pytest.raises(TypeError, match="hidden: dtype"):
        linear_logprob_entropy(x.bfloat16(), w, y)
    with pytest.raises(TypeError, match="weight: expected float32"):
        linear_logprob_entropy(x, w.long(), y)
    with pytest.raises(ValueError, match="hidden: expected a 2-D"):
        linear_logprob_entropy(x[None], w, y)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator creates (what a [tokens, vocab] logits would be)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_memory_never_exceeds_one_chunk_of_logits():
    n, hidden, vocab, chunk = 256, 16, 1000, 16  # hidden <= chunk: weight-sized grads fit the bound
    x = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    with LargestTensor() as ours:
        r = linear_logprob_entropy(x, w, y, chunk_size=chunk)
        (r.logprob.sum() + r.entropy.sum()).backward()
    with LargestTensor() as stock:
        logp = torch.log_softmax(x @ w.t(), dim=-1)
        (logp.gather(1, y[:, None]).sum() - (logp.exp() * logp).sum()).backward()
    bound = chunk * -(-vocab // 16) * 16  # a chunk's rows, padded to 16 columns (batch invariance)
    assert ours.largest <= bound, (ours.largest, bound)
    assert stock.largest >= n * vocab  # the test would catch a full [tokens, vocab] tensor


# --------------------------------------------------------------------------- tensor parallel


def _tp_kernel_check(vocab_per_rank: int, sequence_parallel: bool, dtype_name: str):
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(11)
    n, hidden = 12 * world, 8
    vocab = vocab_per_rank * world
    dtype = getattr(torch, dtype_name)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[0] = vocab_per_rank - 1  # last id of shard 0
    labels[1] = vocab_per_rank  # first id of shard 1
    labels[2] = vocab - 1  # last id of the last shard
    labels[3] = -100
    temp = torch.rand(n, generator=g) + 0.5
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent, rdx, rdw = _ref_grads(x, w, labels, g_lp, g_ent, temp)
    shard = slice(rank * vocab_per_rank, (rank + 1) * vocab_per_rank)
    tokens = slice(rank * n // world, (rank + 1) * n // world) if sequence_parallel else slice(None)
    r, dx, dw = _grads(
        x[tokens], w[shard], labels, g_lp, g_ent, temperature=temp, chunk_size=5,
        parallel=VocabParallel(group, rank * vocab_per_rank, sequence_parallel),
    )
    return rel(r.logprob, lp), rel(r.entropy, ent), rel(dx, rdx[tokens]), rel(dw, rdw[shard])


def _tp_all(world):
    out = []
    for dtype_name in ("float32", "bfloat16"):
        for vocab_per_rank in (1, 13, 50):
            for sp in (False, True):
                errors = _tp_kernel_check(vocab_per_rank, sp, dtype_name)
                out.append(((dtype_name, vocab_per_rank, sp), errors))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_unsplit(world):
    """Vocab split over TP ranks (shards as Megatron pads them), SP on and off, fp32 and bf16,
    against float64 of the same inputs: values to fp32 rounding (logits stay fp32), gradients to
    the input dtype's (as in the property test); dX reduced once."""
    for rank_rows in run_on_ranks(_tp_all, world, world):
        for (dtype_name, *layout), (lp, ent, dx, dw) in rank_rows:
            grad_tol = {"float32": 1e-5, "bfloat16": 3e-2}[dtype_name]
            assert max(lp, ent) < 1e-5 and max(dx, dw) < grad_tol, (dtype_name, layout, lp, ent, dx, dw)


# --------------------------------------------------------------------------- backend selection


@pytest.mark.parametrize(
    "capability, shared_memory, family",
    [
        ((9, 0), 227 * 1024, "sm_90"),  # H100 / H200
        ((10, 0), 227 * 1024, "sm_90"),  # B200
        ((8, 0), 163 * 1024, "sm_80"),  # A100
        ((8, 6), 99 * 1024, "sm_86"),  # RTX 30xx / A10
        ((8, 9), 99 * 1024, "sm_86"),  # L4 / L40 / RTX 40xx
        ((12, 0), 99 * 1024, "sm_86"),  # RTX 50xx
        ((7, 5), 64 * 1024, None),  # T4: no bf16 tensor cores
        ((8, 6), 48 * 1024, None),  # nothing fits: the torch backend
    ],
)
def test_triton_tiles_are_chosen_by_compute_capability_and_shared_memory(capability, shared_memory, family):
    from mcore_hooks.kernels.triton_backend import triton_tiles

    tiles = triton_tiles.tiles_for(capability, shared_memory)
    assert (tiles.name if tiles else None) == family
    if tiles is not None:
        assert tiles.shared_memory() <= shared_memory
        assert not tiles.tma or capability >= (9, 0)  # the bulk copy engine is Hopper's


def test_backend_in_use_is_visible(caplog, monkeypatch):
    import logging

    from mcore_hooks.kernels.passes import arguments
    from mcore_hooks.kernels import backend_for
    from mcore_hooks.kernels.triton_backend import triton_tiles

    assert backend_for(torch.float32, "cpu") == "torch"
    with pytest.raises(ValueError, match="backend: expected one of"):
        backend_for(torch.float32, "cpu", "fast")
    arguments._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="mcore_hooks.kernels"):
        linear_logprob_entropy(torch.randn(2, 4), torch.randn(3, 4))
    assert "backend='auto' runs torch for torch.float32 inputs on cpu" in caplog.text
    monkeypatch.setattr(triton_tiles, "device_tiles", lambda device: None)  # a GPU nothing fits
    with pytest.raises(ValueError, match="backend: 'triton' needs bf16/fp16 inputs on a CUDA GPU"):
        backend_for(torch.bfloat16, "cpu", "triton")


def _grid_cost(row_blocks: int, vtiles: int, sms: int, splits: int) -> int:
    """Waves x vocab tiles per program of the statistics kernel's grid, as it launches."""
    per_split = math.ceil(vtiles / min(vtiles, splits))
    return math.ceil(row_blocks * math.ceil(vtiles / per_split) / sms) * per_split


def _check_forward_splits(row_blocks: int, vtiles: int, sms: int) -> None:
    """forward_splits against every split count from 4 (or ``vtiles``, if fewer) to ``vtiles``
    (brute force, not the rule's own candidates): at least 4 (or every unit); where some such
    count fits the GPU at once, a one-wave grid whose programs walk within 2% of the fewest
    units any one-wave count gives them; where none fits, a grid within 2% of the one the
    earlier fixed rule (the fewest splits giving two programs per SM) launched."""
    from mcore_hooks.kernels.triton_backend.triton_fused import forward_splits

    s = forward_splits(row_blocks, vtiles, sms)
    assert min(4, vtiles) <= s <= vtiles

    def per_program(c: int) -> int:
        return math.ceil(vtiles / c)

    def fits(c: int) -> bool:  # the splits the launch makes of c: ceil(vtiles / per program)
        return row_blocks * math.ceil(vtiles / per_program(c)) <= sms

    one_wave = [per_program(c) for c in range(min(4, vtiles), vtiles + 1) if fits(c)]
    if one_wave:
        assert fits(s) and per_program(s) <= 1.02 * min(one_wave)
    else:
        fixed = max(4, math.ceil(2 * sms / row_blocks))
        assert _grid_cost(row_blocks, vtiles, sms, s) <= 1.02 * _grid_cost(row_blocks, vtiles, sms, fixed)


@settings(max_examples=300, deadline=None)
@given(row_blocks=st.integers(1, 4096), vtiles=st.integers(1, 2048), sms=st.integers(1, 256))
def test_forward_splits_any_grid(row_blocks, vtiles, sms):
    _check_forward_splits(row_blocks, vtiles, sms)


@settings(max_examples=300, deadline=None)
@given(row_blocks=st.integers(1, 16), vtiles=st.integers(1, 1024), sms=st.integers(16, 160))
def test_forward_splits_the_grids_the_kernel_launches(row_blocks, vtiles, sms):
    # a group has at most 16 row blocks (_FWD_GROUP / 128): mostly the one-wave case
    _check_forward_splits(row_blocks, vtiles, sms)


def test_forward_splits_keep_a_groups_programs_in_one_wave():
    # 2048 tokens (16 row blocks) x 151936 (198 segments of 3 tiles) on 132 SMs: 8 splits in
    # one wave, not 33 splits in four waves of shorter programs (fewer units a program, yet
    # 4.27 ms against 3.93-3.95 on an H200; likely the weight read again for each wave's row
    # blocks); 256 tokens (2 row blocks): 66 splits fill the GPU.
    from mcore_hooks.kernels.triton_backend.triton_fused import forward_splits

    assert forward_splits(16, 198, 132) == 8
    assert forward_splits(2, 198, 132) == 66


def test_a_fused_loss_keeps_its_logit_gradient_only_for_few_tokens():
    """The Triton fused losses form dW in the backward from the kept logit gradient up to 1024
    tokens and 512 MiB of it (faster there: no float32 dW written, read and scaled), in float32
    in the forward past either (git show 5992123:benchmarks/RESULTS.md, 2026-11-27); never with an accumulator,
    sequence parallelism, more than one chunk, or the torch backend. Shapes alone, as the fake
    sees."""
    from mcore_hooks.kernels.passes.loss_op import _defers_weight_grad

    def defers(n, v=151936, backend="triton", chunk=1 << 20, sp=False, need_w=True, into=False):
        w = torch.empty((v, 8), dtype=torch.bfloat16, device="meta")
        return _defers_weight_grad(backend, n, w, chunk, sp, need_w, into)

    assert defers(1024) and not defers(1025)
    assert defers(1024, v=32000) and not defers(1025, v=32000)
    assert not defers(1024, v=300000)  # 586 MiB of logit gradient
    assert not defers(256, backend="torch") and not defers(256, sp=True) and not defers(256, into=True)
    assert not defers(256, chunk=128) and not defers(256, need_w=False)


def test_a_kept_logit_gradient_is_scaled_in_float32_and_rounded_once():
    """The kept logit gradient times the upstream gradient: the product in float32, rounded
    once to the gradient's dtype (a 16-bit tensor times a float32 scalar tensor would, on a
    GPU, multiply in the 16-bit dtype with the scalar rounded first; on the CPU torch's mul
    already computes in float32, so this guards the torch form's formula, and
    tests/test_gpu.py the Triton pass's); a new tensor, the kept one left for a retained
    graph's second backward."""
    from mcore_hooks.kernels.passes.loss_op import _scaled_logit_grad

    g = torch.Generator().manual_seed(5)
    dz = (torch.randn(8, 300, generator=g) * 1e-3).bfloat16()
    before = dz.clone()
    for grad in (1.0, 0.37, 1 / 3, 2.0**-3):
        t = torch.tensor(grad)
        out = _scaled_logit_grad(dz, t)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, (dz.float() * t).bfloat16())
    assert torch.equal(dz, before)


def test_the_triton_fused_losses_make_a_chunks_logits_at_once_where_they_fit():
    """Each launch of the logits kernel reads all of W, so the Triton backend makes a chunk's
    float32 logits in one launch where they and the chunk's logit gradient fit its budget (a
    call of one chunk is sized to its own tokens, so the chunk size cannot say so); past that,
    and on the torch backend (whose fixed-shape blocks set their tiling through the chunk
    size), half a chunk at a time."""
    from mcore_hooks.kernels.common.autograd import Backend
    from mcore_hooks.kernels.triton_backend.triton_fused import TritonFused

    tri, v = TritonFused(), 151936
    fits = TritonFused.fused_chunk_bytes // (v * 6)  # bf16 logit gradient + float32 logits
    assert tri.logits_rows(256, 256, 256, v, 2, False) == 256
    assert tri.logits_rows(fits, fits, fits, v, 2, False) == fits
    assert tri.logits_rows(fits + 1, fits + 1, fits + 1, v, 2, False) == -(-(fits + 1) // 2)
    deep = TritonFused.accumulating_chunk_bytes // (v * 6)
    assert tri.logits_rows(deep + 1, deep + 1, deep + 1, v, 2, True) == -(-(deep + 1) // 2)
    assert Backend().logits_rows(256, 256, 256, v, 2, False) == 128
    assert Backend().logits_rows(256, 256, 512, v, 2, False) == 256


def test_forward_splits_fills_one_wave_where_the_fixed_rule_left_a_sliver():
    # 4096 tokens (32 row blocks of 128) x 151936 vocab (594 tiles of 256) on 132 SMs: the fixed
    # rule's 9 splits launch 288 programs, three waves, the last of 24; 4 splits launch one wave.
    from mcore_hooks.kernels.triton_backend.triton_fused import forward_splits

    assert forward_splits(32, 594, 132) == 4
    assert _grid_cost(32, 594, 132, 4) == 149 < _grid_cost(32, 594, 132, 9) == 198


# --------------------------------------------------------------------------- edges of a call's life


def _double_backward_cases():
    from mcore_hooks.kernels import linear_cross_entropy, linear_policy_loss

    g = torch.Generator().manual_seed(11)
    n, h, v = 6, 4, 10
    y = torch.randint(0, v, (n,), generator=g)
    tw = torch.rand(n, generator=g)
    inp = {"old_logprobs": -torch.rand(n, generator=g), "advantages": torch.randn(n, generator=g)}
    acc = torch.zeros(v, h)
    return n, h, v, {
        "cross-entropy": lambda x, w: linear_cross_entropy(x, w, y, backend="torch"),
        "policy-loss-op": lambda x, w: linear_policy_loss(x, w, y, token_weight=tw, inputs=inp,
                                                          backend="torch").loss,
        "per-token-loss": lambda x, w: linear_policy_loss(
            x, w, y, token_weight=tw, inputs={"advantages": inp["advantages"]}, backend="torch",
            loss=lambda lp, ent, advantages: -advantages * lp).loss,
        "declared-upstream-grad": lambda x, w: linear_policy_loss(
            x, w, y, token_weight=tw, inputs=inp, backend="torch", weight_grad_accumulator=acc,
            upstream_grad=1.0).loss,
    }


@pytest.mark.parametrize("case", list(_double_backward_cases()[3]))
def test_a_double_backward_through_the_fused_losses_raises(case):
    """The fused losses form their gradients in the forward from float32 values that hold no
    graph: a gradient taken with ``create_graph=True`` must not pass for a differentiable one
    (``loss + |dL/dx|^2`` backpropagated exactly the plain loss's gradient). It carries a node
    that raises when differentiated, as the log-prob pass's does; its value is the plain one."""
    n, h, v, cases = _double_backward_cases()
    g = torch.Generator().manual_seed(12)
    x0, w0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    plain, = torch.autograd.grad(cases[case](x, w), x)
    loss = cases[case](x, w)
    dx, = torch.autograd.grad(loss, x, create_graph=True)
    assert torch.equal(dx.detach(), plain)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        (loss + dx.square().sum()).backward()


@pytest.mark.parametrize("invariant", [False, True], ids=["opted-out", "batch-invariant"])
def test_a_call_with_no_tokens_gives_empty_results_and_zero_gradients(invariant):
    """``[0, H]`` hidden states (an empty micro-batch or shard) through every entry point and
    option: empty per-token results, a zero loss, and zero gradients for the hidden states and
    the weight (the weight's hooks still run), batch-invariant (the default) and opted out."""
    from mcore_hooks.kernels import (Truncation, linear_cross_entropy, linear_logprob_entropy,
                                     linear_policy_loss)

    h, v = 4, 10
    y = torch.zeros(0, dtype=torch.long)
    ids = torch.zeros(0, 3, dtype=torch.long)
    zero = torch.zeros(0)
    opts = dict(backend="torch", batch_invariant=invariant)
    calls = {
        "logprob": lambda x, w: linear_logprob_entropy(x, w, y, **opts),
        "entropy": lambda x, w: linear_logprob_entropy(x, w, None, **opts),
        "kept": lambda x, w: linear_logprob_entropy(x, w, y, kept_ids=ids, **opts),
        "truncation": lambda x, w: linear_logprob_entropy(x, w, y, truncation=Truncation(top_k=3), **opts),
        "selected": lambda x, w: linear_logprob_entropy(x, w, y, selected_ids=ids, **opts),
        "cross-entropy": lambda x, w: linear_cross_entropy(x, w, y, **opts),
        "policy": lambda x, w: linear_policy_loss(x, w, y, token_weight=zero, inputs={
            "old_logprobs": zero, "advantages": zero}, **opts),
        "policy-declared": lambda x, w: linear_policy_loss(
            x, w, y, token_weight=zero, inputs={"old_logprobs": zero, "advantages": zero},
            weight_grad_accumulator=torch.zeros(v, h), upstream_grad=1.0, **opts),
    }
    for name, call in calls.items():
        x = torch.zeros(0, h, requires_grad=True)
        w = torch.randn(v, h).requires_grad_()
        seen = []
        w.register_hook(lambda g: seen.append(g))
        r = call(x, w)
        outs = [r] if isinstance(r, torch.Tensor) else [t for t in r if t is not None]
        total = outs[0] if outs[0].dim() == 0 else sum(t.float().sum() for t in outs if t.requires_grad)
        assert all(t.shape[0] == 0 for t in outs if t.dim()), name
        assert total.item() == 0.0 and total.requires_grad, name
        total.backward()
        assert x.grad is not None and x.grad.shape == (0, h), name
        assert len(seen) == 1 and not seen[0].any(), name
