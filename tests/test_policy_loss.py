"""The fused policy loss (gradients formed in the forward) on plain tensors, against verl's
formulas over float64 logits (the unfused stock path), the two-pass path, and TP=2."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_hooks.kernels import (
    PolicyLoss,
    VocabParallel,
    aggregation_weights,
    linear_logprob_entropy,
    linear_policy_loss,
    per_token_loss,
)
from mcore_hooks.testing import run_on_ranks
from test_kernels import LargestTensor, rel
from tolerances import U32, accumulator_bound, grad_bounds, logit_grad_reference, logprob_error, ratio

pytestmark = pytest.mark.release_independent


# --------------------------------------------------------------------------- the stock path


def _verl_terms(lp, ent, old, adv, ref, cfg: PolicyLoss):
    """verl's compute_policy_loss_vanilla + kl_penalty + entropy bonus, per token (written out
    here as verl writes it, independently of PolicyLoss)."""
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - cfg.clip_low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    if cfg.dual_clip is not None:
        pg_losses3 = -adv * cfg.dual_clip
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg = clip_pg_losses1
    if cfg.kl_coef != 0:
        if cfg.kl_type == "k1":
            kl = lp - ref
        else:
            kl = torch.clamp(ref - lp, min=-20, max=20)
            kl = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        pg = pg + cfg.kl_coef * kl
    if cfg.entropy_coef != 0:
        pg = pg - cfg.entropy_coef * ent
    return pg


def _verl_agg(loss_mat, mask, mode):
    """verl's agg_loss on [B, S] (one data-parallel rank)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    if mode == "token-sum":
        return (loss_mat * mask).sum()
    seq_mask = mask.sum(-1)
    if mode == "seq-mean-token-sum":
        seq_losses = (loss_mat * mask).sum(-1)
    else:
        seq_losses = torch.where(seq_mask > 0, (loss_mat * mask).sum(-1) / seq_mask.clamp(min=1), 0.0)
    active = (seq_mask > 0).to(loss_mat.dtype)
    return (seq_losses * active).sum() / active.sum().clamp(min=1)


def _stock(x, w, labels, mask, inputs, cfg, mode, bs, temperature=1.0, scale=1.0):
    """float64: full logits, log_softmax, verl's loss; returns the loss, dX, dW, the log-probs
    and the loss' derivatives in each token's log-prob and entropy."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    t = temperature.double().unsqueeze(1) if torch.is_tensor(temperature) else temperature
    logp = torch.log_softmax(xd @ wd.t() * scale / t, dim=-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    lp_leaf, ent_leaf = lp.detach().requires_grad_(), ent.detach().requires_grad_()
    m = (mask * valid).double()
    d = {k: v.double() for k, v in inputs.items()}
    terms = _verl_terms(lp_leaf, ent_leaf, d["old_logprobs"], d["advantages"], d.get("ref_logprobs"), cfg)
    terms = torch.where(m > 0, terms, 0.0)
    loss = _verl_agg(terms.view(bs), m.view(bs), mode)
    g_lp, g_ent = torch.autograd.grad(loss, [lp_leaf, ent_leaf], allow_unused=True)
    g_ent = torch.zeros_like(g_lp) if g_ent is None else g_ent
    (lp * g_lp + ent * g_ent).sum().backward()
    return loss.detach(), xd.grad, wd.grad, lp.detach(), ent.detach(), g_lp, g_ent


def _ours(x, w, labels, weights, inputs, cfg, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    r = linear_policy_loss(x, w, labels, token_weight=weights, loss=cfg, inputs=inputs, **kw)
    r.loss.backward()
    return r, x.grad, w.grad


def _away_from(delta, bounds, gap=1e-3):
    """Push log-ratios at least ``gap`` from the clip bounds: fp32 log-probs (a few ulps from the
    float64 ones) must take the same side of every ``clamp`` as the reference."""
    for b in bounds:
        near = (delta - b).abs() < gap
        delta = torch.where(near, b + gap * torch.sign(delta - b + 1e-12) * 2, delta)
    return delta


@st.composite
def policy_problems(draw):
    b, s = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    n = b * s
    vocab = draw(st.sampled_from([2, 7, 97, 1015]))
    hidden = draw(st.sampled_from([1, 8, 24]))
    chunk = draw(st.integers(1, 64))
    temperature = draw(st.one_of(st.floats(0.5, 2.0), st.just("per-token")))
    scale = draw(st.sampled_from([1.0, 0.25]))
    clip_low = draw(st.sampled_from([0.1, 0.2]))
    cfg = PolicyLoss(
        clip_low=clip_low,
        clip_high=draw(st.sampled_from([None, 0.28])),
        dual_clip=draw(st.sampled_from([None, 3.0])),
        kl_coef=draw(st.sampled_from([0.0, 0.05])),
        kl_type=draw(st.sampled_from(["k1", "k3"])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, -0.003])),
    )
    mode = draw(st.sampled_from(["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < draw(st.floats(0.0, 0.5))] = -100
    mask = (torch.rand(n, generator=g) < draw(st.floats(0.3, 1.0))).float()
    temp = torch.rand(n, generator=g) * 1.5 + 0.5 if temperature == "per-token" else temperature
    return dict(b=b, s=s, x=x, w=w, labels=labels, mask=mask, temp=temp, scale=scale, cfg=cfg,
                mode=mode, chunk=chunk, gen=g)


def _inputs_around(lp64, cfg, g):
    """old / reference log-probs near the current ones (ratios 0.6..1.6, across the clip
    bounds, never within 1e-3 of one), advantages of both signs."""
    n = lp64.shape[0]
    high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    delta = _away_from(torch.rand(n, generator=g, dtype=torch.float64) - 0.5,
                       [math.log(1 - cfg.clip_low), math.log(1 + high)])
    return {
        "old_logprobs": (lp64 - delta).float(),
        "advantages": torch.randn(n, generator=g),
        "ref_logprobs": (lp64 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float(),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pb=policy_problems())
def test_matches_verl_over_float64_logits(pb):
    """fp32 inputs: the loss, the per-token log-probs and both gradients against verl's loss over
    float64 logits, within fp32's rounding of each quantity."""
    x, w, labels, cfg, mode, g = pb["x"], pb["w"], pb["labels"], pb["cfg"], pb["mode"], pb["gen"]
    b, s, n = pb["b"], pb["s"], pb["b"] * pb["s"]
    temp, scale = pb["temp"], pb["scale"]
    t = temp.double().unsqueeze(1) if torch.is_tensor(temp) else temp
    lp64 = torch.log_softmax(x.double() @ w.double().t() * scale / t, -1).gather(
        1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    inputs = _inputs_around(lp64, cfg, g)
    if cfg.kl_coef == 0:
        del inputs["ref_logprobs"]
    valid = (labels != -100).float()
    seq = torch.arange(b).repeat_interleave(s)
    weights = aggregation_weights(pb["mask"] * valid, mode, sequence_ids=seq, num_sequences=b)
    r, dx, dw = _ours(x, w, labels, weights, inputs, cfg, temperature=temp, logit_scale=scale,
                      chunk_size=pb["chunk"])
    ref, rdx, rdw, rlp, rent, g_lp, g_ent = _stock(x, w, labels, pb["mask"], inputs, cfg, mode, (b, s), temp, scale)
    assert r.loss.dtype == torch.float32 and r.loss.shape == ()
    # each log-prob/entropy is within 1e-5 (1 + max) of float64 (the kernels' own bound); the loss
    # moves by the loss' derivative times that, plus fp32 rounding of the terms and their sum
    e_lp = 1e-5 * (1 + rlp.abs().max().item())
    e_ent = 1e-5 * (1 + rent.abs().max().item())
    bound = (g_lp.abs() * e_lp + g_ent.abs() * e_ent).sum().item() + 1e-6 * (1 + abs(float(ref)))
    assert abs(float(r.loss.detach()) - float(ref)) <= bound, (float(r.loss.detach()), float(ref), bound)
    assert (r.logprob.double() - rlp).abs().max() <= e_lp
    if cfg.needs_entropy:
        assert (r.entropy.double() - rent).abs().max() <= e_ent
    else:
        assert torch.all(r.entropy == 0)
    # Gradients: the per-token derivatives carry the log-probs' error relatively (d ratio = ratio
    # d logp), then the logit gradient is formed in fp32 (a few ulps of 1 times the derivatives and
    # the logit coefficient, absolutely: see test_kernels).
    coef = scale / (temp if torch.is_tensor(temp) else torch.full((n,), temp))
    unit = 4 * 2.0**-23 * (coef * (g_lp.abs() + g_ent.abs())).max().item()
    tol = 1e-5 + e_lp + e_ent
    assert (dx.double() - rdx).norm() <= tol * rdx.norm() + unit * w.double().norm()
    assert (dw.double() - rdw).norm() <= tol * rdw.norm() + unit * x.double().norm()
    counted = weights != 0
    assert torch.all(dx[~counted] == 0)
    # no gradient wanted: the same value from the log-prob pass
    with torch.no_grad():
        plain = linear_policy_loss(x, w, labels, token_weight=weights, loss=cfg, inputs=inputs,
                                   temperature=temp, logit_scale=scale)
    assert abs(float(plain.loss) - float(ref)) <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_fused_equals_two_pass_in_low_precision(dtype, entropy_coef):
    """bf16/fp16: the fused loss and the log-prob path followed by the same loss in torch (the
    two-pass path) agree: values to fp32 rounding, gradients to the input dtype's."""
    g = torch.Generator().manual_seed(11)
    n, hidden, vocab = 96, 32, 1031
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100
    cfg = PolicyLoss(clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=entropy_coef)
    lp0 = linear_logprob_entropy(x, w, labels).logprob.double()
    inputs = _inputs_around(lp0, cfg, g)
    weights = aggregation_weights((torch.rand(n, generator=g) < 0.8).float() * (labels != -100), "token-mean")
    r, dx, dw = _ours(x, w, labels, weights, inputs, cfg, temperature=0.7, chunk_size=17)

    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    two = linear_logprob_entropy(xt, wt, labels, temperature=0.7, chunk_size=17)
    loss = (cfg(two.logprob, two.entropy, **inputs) * weights).sum()
    loss.backward()
    assert abs(float(r.loss.detach()) - float(loss.detach())) <= 1e-6 * (1 + abs(float(loss.detach())))
    assert torch.equal(r.logprob, two.logprob.detach())
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert rel(dx, xt.grad) < tol and rel(dw, wt.grad) < tol
    assert dx.dtype == dtype and dw.dtype == dtype


def _gspo_loss(lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO (arXiv:2507.18071) as verl writes it: a sequence-level ratio, so every token's term
    depends on its whole sequence: not a per-token loss."""
    neg_kl = lp - old
    seq_len = mask.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * mask).sum(-1) / seq_len
    log_ratio = torch.clamp(lp - lp.detach() + neg_kl_seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return _verl_agg(pg, mask, "seq-mean-token-mean")


def test_gspo_takes_the_two_pass_path():
    """Sequence-level objectives: the differentiable log-prob pass, then the loss in torch (the
    documented path), equals GSPO over float64 logits."""
    g = torch.Generator().manual_seed(4)
    b, s, hidden, vocab = 3, 10, 16, 257
    x = torch.randn(b * s, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / 4
    labels = torch.randint(0, vocab, (b * s,), generator=g)
    mask = (torch.rand(b, s, generator=g) < 0.8).float()
    old = -torch.rand(b, s, generator=g) * 6
    adv = torch.randn(b, 1, generator=g).expand(b, s)
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp = linear_logprob_entropy(xo, wo, labels, chunk_size=7).logprob.view(b, s)
    ours = _gspo_loss(lp, old, adv, mask)
    ours.backward()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    lpd = torch.log_softmax(xd @ wd.t(), -1).gather(1, labels.unsqueeze(1)).view(b, s)
    ref = _gspo_loss(lpd, old.double(), adv.double(), mask.double())
    ref.backward()
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-6 * (1 + abs(float(ref.detach())))
    assert rel(xo.grad, xd.grad) < 1e-5 and rel(wo.grad, wd.grad) < 1e-5


def test_custom_per_token_function():
    """A plain-torch per-token function (REINFORCE with importance weights and an entropy
    term) gets autograd's derivatives; entropy=None where it is told not to need it."""
    g = torch.Generator().manual_seed(8)
    n, hidden, vocab = 40, 8, 97
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    adv, is_w = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5
    weights = torch.rand(n, generator=g)

    def reinforce(logprob, entropy, *, advantages, is_weights):
        return -advantages * is_weights * logprob - 0.01 * entropy

    inputs = {"advantages": adv, "is_weights": is_w}
    r, dx, dw = _ours(x, w, labels, weights, inputs, reinforce, chunk_size=9)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    logp = torch.log_softmax(xd @ wd.t(), -1)
    lp = logp.gather(1, labels.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    ref = (reinforce(lp, ent, advantages=adv.double(), is_weights=is_w.double()) * weights.double()).sum()
    ref.backward()
    assert abs(float(r.loss.detach()) - float(ref.detach())) <= 1e-5 * (1 + abs(float(ref.detach())))
    assert rel(dx, xd.grad) < 1e-5 and rel(dw, wd.grad) < 1e-5
    assert rel(r.entropy, ent.detach()) < 1e-6  # it read the entropy, so it was computed

    def no_entropy(logprob, entropy, *, advantages):
        assert entropy is None
        return -advantages * logprob

    fn = per_token_loss(no_entropy, needs_entropy=False)
    r2, _, _ = _ours(x, w, labels, weights, {"advantages": adv}, fn)
    assert torch.all(r2.entropy == 0)
    assert abs(float(r2.loss.detach()) - float((-adv * r.logprob * weights).sum())) <= 1e-5 * float(r2.loss.detach().abs() + 1)


def test_masked_inputs_may_hold_nan():
    """Padding often holds NaN / garbage old log-probs: positions that do not count contribute
    neither value nor gradient."""
    g = torch.Generator().manual_seed(2)
    n, hidden, vocab = 12, 8, 31
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[3] = -100
    mask = torch.ones(n)
    mask[5] = 0
    old = -torch.rand(n, generator=g) * 3
    adv = torch.randn(n, generator=g)
    old_bad, adv_bad = old.clone(), adv.clone()
    old_bad[[3, 5]] = float("nan")
    adv_bad[[3, 5]] = float("inf")
    weights = aggregation_weights(mask * (labels != -100), "token-mean")
    clean = _ours(x, w, labels, weights, {"old_logprobs": old, "advantages": adv}, PolicyLoss())
    dirty = _ours(x, w, labels, weights, {"old_logprobs": old_bad, "advantages": adv_bad}, PolicyLoss())
    assert torch.equal(clean[0].loss, dirty[0].loss)
    assert torch.equal(clean[1], dirty[1]) and torch.equal(clean[2], dirty[2])


def test_memory_holds_one_chunk_of_logits_and_fp32_gradients():
    n, hidden, vocab, chunk = 256, 16, 1000, 8
    x = torch.randn(n, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    inputs = {"old_logprobs": -torch.rand(n) * 5, "advantages": torch.randn(n)}
    with LargestTensor() as ours:
        linear_policy_loss(x, w, y, token_weight=torch.full((n,), 1 / n), inputs=inputs,
                           loss=PolicyLoss(entropy_coef=0.01), chunk_size=chunk).loss.backward()
    assert ours.largest <= max(chunk * vocab, vocab * hidden, n * hidden), ours.largest


def test_aggregation_weights_are_verls_agg_loss():
    g = torch.Generator().manual_seed(1)
    b, s = 4, 6
    mask = (torch.rand(b, s, generator=g) < 0.6).float()
    mask[2] = 0  # a sequence with no token counted: not in the sequence mean
    terms = torch.randn(b, s, generator=g, dtype=torch.float64)
    seq = torch.arange(b).repeat_interleave(s)
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"):
        wts = aggregation_weights(mask.reshape(-1), mode, sequence_ids=seq, num_sequences=b)
        got = (wts.double() * terms.reshape(-1)).sum()
        torch.testing.assert_close(got, _verl_agg(terms, mask.double(), mode), rtol=1e-6, atol=1e-7)
    empty = aggregation_weights(torch.zeros(5), "token-mean")
    assert torch.all(empty == 0)


def test_bad_input_names_the_argument():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    y = torch.tensor([1, 2, 3, -100])
    ok = {"old_logprobs": torch.zeros(4), "advantages": torch.zeros(4)}
    tw = torch.ones(4)
    with pytest.raises(ValueError, match="labels: linear_policy_loss needs"):
        linear_policy_loss(x, w, None, token_weight=tw, inputs=ok)
    with pytest.raises(ValueError, match=r"token_weight: expected shape \(4,\)"):
        linear_policy_loss(x, w, y, token_weight=torch.ones(3), inputs=ok)
    with pytest.raises(ValueError, match="token_weight: every value must be finite"):
        linear_policy_loss(x, w, y, token_weight=torch.tensor([1.0, float("nan"), 1, 1]), inputs=ok)
    with pytest.raises(ValueError, match="inputs: missing 'advantages'"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs={"old_logprobs": torch.zeros(4)})
    with pytest.raises(ValueError, match="inputs: missing 'ref_logprobs'"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs=ok, loss=PolicyLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="inputs: unexpected 'advantage'"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs={**ok, "advantage": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"inputs\['advantages'\]: expected shape \(4,\)"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs={**ok, "advantages": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"inputs\['advantages'\]: NaN or infinite"):
        linear_policy_loss(x, w, y, token_weight=tw,
                           inputs={**ok, "advantages": torch.tensor([0.0, float("nan"), 0, 0])})
    with pytest.raises(TypeError, match="loss: expected a PolicyLoss or a per-token function"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs=ok, loss="ppo")
    with pytest.raises(ValueError, match="loss: the per-token function must return one value per token"):
        linear_policy_loss(x, w, y, token_weight=tw, inputs=ok, loss=lambda lp, ent, **k: lp.sum())
    for kw, match in [
        (dict(clip_low=1.2), "clip_low"), (dict(clip_high=-0.1), "clip_high"),
        (dict(dual_clip=0.5), "dual_clip"), (dict(kl_type="k2"), "kl_type"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
    ]:
        with pytest.raises(ValueError, match=match):
            PolicyLoss(**kw)
    with pytest.raises(ValueError, match="mode: expected one of"):
        aggregation_weights(torch.ones(4), "seq-mean")
    with pytest.raises(ValueError, match="num_sequences: expected a positive int"):
        aggregation_weights(torch.ones(4), "seq-mean-token-mean", sequence_ids=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sequence_ids: values must lie in \[0, 2\)"):
        aggregation_weights(torch.ones(4), "seq-mean-token-sum", sequence_ids=torch.arange(4), num_sequences=2)


def _tp_check(vocab_per_rank: int, sequence_parallel: bool):
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(17)
    b, s, hidden = 2, 6 * world, 8
    n, vocab = b * s, vocab_per_rank * world
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[0], labels[1], labels[2], labels[3] = vocab_per_rank - 1, vocab_per_rank, vocab - 1, -100
    temp = torch.rand(n, generator=g) + 0.5
    mask = (torch.rand(n, generator=g) < 0.8).float()
    cfg = PolicyLoss(clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
    lp64 = torch.log_softmax(x.double() @ w.double().t() / temp.double().unsqueeze(1), -1).gather(
        1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    inputs = _inputs_around(lp64, cfg, g)
    mode = "seq-mean-token-mean"
    seq = torch.arange(b).repeat_interleave(s)
    weights = aggregation_weights(mask * (labels != -100), mode, sequence_ids=seq, num_sequences=b)
    ref, rdx, rdw, *_ = _stock(x, w, labels, mask, inputs, cfg, mode, (b, s), temp)
    shard = slice(rank * vocab_per_rank, (rank + 1) * vocab_per_rank)
    tokens = slice(rank * n // world, (rank + 1) * n // world) if sequence_parallel else slice(None)
    r, dx, dw = _ours(
        x[tokens], w[shard], labels, weights, inputs, cfg, temperature=temp, chunk_size=5,
        parallel=VocabParallel(group, rank * vocab_per_rank, sequence_parallel),
    )
    return abs(float(r.loss) - float(ref)) / abs(float(ref)), rel(dx, rdx[tokens]), rel(dw, rdw[shard])


def _tp_all(world):
    return [((v, sp), _tp_check(v, sp)) for v in (1, 13) for sp in (False, True)]


def test_vocab_parallel_matches_unsplit():
    for rank_rows in run_on_ranks(_tp_all, 2, 2):
        for layout, errors in rank_rows:
            assert max(errors) < 1e-5, (layout, errors)


# --------------------------------------------------------------------------- main_grad


def _accumulator_problem(seed: int):
    """A small problem (30 tokens, one ignored) with policy inputs and token weights."""
    g = torch.Generator().manual_seed(seed)
    n, hidden, vocab = 30, 8, 53
    x, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) / 3
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[4] = -100
    inputs = {"old_logprobs": -torch.rand(n, generator=g) * 5, "advantages": torch.randn(n, generator=g)}
    return x, w, labels, inputs, torch.rand(n, generator=g)


def _accumulator_reference(x, w, labels, inputs, tw, entry, cfg, up, temperature=1.0):
    """float64 logit gradient of the entry's loss (times ``up``), and the relative error of its
    derivatives in the log-prob and entropy as formed in fp32: a few roundings (the weight, the
    upstream gradient, the advantage); the policy's ratio exp(logprob - old) also carries the
    fp32 log-prob's error, relatively (d ratio = ratio d logprob)."""
    twd = tw.double()

    def terms(lp, ent):
        if entry == "logprob":
            return up * (lp * twd + ent)
        if entry == "cross_entropy":
            return up * twd * -lp
        d = {k: v.double() for k, v in inputs.items()}
        return up * twd * _verl_terms(lp, ent, d["old_logprobs"], d["advantages"], None, cfg)

    ref = logit_grad_reference(x, w, labels, terms, temperature)
    g_rel = 8 * U32 + (logprob_error(ref, x, w).squeeze(1) if entry == "policy" else 0.0)
    return ref, g_rel


def _accumulated(ref, g_rel, x, w, start, acc):
    """|acc - float64 (start + up dW)| over its bound, entry by entry (<= 1 passes): not
    ``acc - start`` against fp32 dW, which loses fp32 digits of ``start`` (|start| ~ 1 against
    entries of dW down to 1e-4) in the subtraction. The bound (tests/tolerances.py): the fp32 roundings
    of ``start`` as products are added into it (up to one a token), plus dW's own fp32 error,
    which scales with the sum of |terms| of its product, |dz|^T |x| (dz the float64 logit
    gradient), not with dW."""
    return ratio(acc, start.double() + ref.dw, accumulator_bound(ref, x, w, start, g_rel))


@pytest.mark.parametrize("entry", ["logprob", "cross_entropy", "policy"])
def test_weight_gradient_into_an_fp32_accumulator(entry):
    """With ``weight_grad_accumulator`` the weight's gradient (scaled by the upstream gradient)
    is added into it and the weight gets none (or a zero placeholder); dX is unchanged."""
    from mcore_hooks.kernels import linear_cross_entropy

    x, w, labels, inputs, tw = _accumulator_problem(6)
    vocab, hidden = w.shape
    g = torch.Generator().manual_seed(9)
    cfg = PolicyLoss(entropy_coef=0.01)

    def run(**kw):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if entry == "logprob":
            r = linear_logprob_entropy(xr, wr, labels, temperature=0.9, chunk_size=7, **kw)
            loss = (r.logprob * tw).sum() + r.entropy.sum()
        elif entry == "cross_entropy":
            loss = linear_cross_entropy(xr, wr, labels, token_weight=tw, chunk_size=7, **kw)
        else:
            loss = linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs,
                                      chunk_size=7, **kw).loss
        (loss * -0.37).backward()
        return loss.detach(), xr.grad, wr.grad

    ref, rdx, _ = run()
    start = torch.randn(vocab, hidden, generator=g)
    acc = start.clone()
    loss, dx, dw = run(weight_grad_accumulator=acc)
    assert dw is None
    assert abs(float(loss) - float(ref)) <= 1e-6 * (1 + abs(float(ref)))
    ref64, g_rel = _accumulator_reference(x, w, labels, inputs, tw, entry, cfg, -0.37,
                                          0.9 if entry == "logprob" else 1.0)
    # dX as without (another path for the losses: the log-prob pass): both within fp32's
    # rounding of float64, entry by entry (tests/tolerances.py)
    bdx = grad_bounds(ref64, x, w, torch.float32, g_rel).dx
    assert ratio(dx, ref64.dx, bdx) <= 1 and ratio(rdx, ref64.dx, bdx) <= 1
    err = _accumulated(ref64, g_rel, x, w, start, acc)
    assert err <= 1, err
    acc2 = start.clone()
    _, _, placeholder = run(weight_grad_accumulator=acc2, placeholder_weight_grad=True)
    assert placeholder is not None and not placeholder.any() and torch.equal(acc2, acc)
    with pytest.raises(ValueError, match="weight_grad_accumulator: expected a float32 tensor"):
        run(weight_grad_accumulator=torch.zeros(vocab, hidden, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight_grad_accumulator: expected a float32 tensor"):
        run(weight_grad_accumulator=torch.zeros(vocab + 1, hidden))


@pytest.mark.parametrize("entry", ["cross_entropy", "policy"])
def test_a_declared_upstream_gradient_adds_into_the_accumulator_in_the_forward(entry):
    """``upstream_grad`` with an accumulator: the weight's gradient, scaled by the declared
    upstream gradient, is in the accumulator once the forward returns (formed there, 6NHV); the
    backward leaves it alone, gives dX as without, and rejects another upstream gradient."""
    from mcore_hooks.kernels import linear_cross_entropy

    x, w, labels, inputs, tw = _accumulator_problem(7)
    vocab, hidden = w.shape
    g = torch.Generator().manual_seed(8)
    up = -0.37
    cfg = PolicyLoss(entropy_coef=0.01)

    def forward(xr, wr, **kw):
        if entry == "cross_entropy":
            return linear_cross_entropy(xr, wr, labels, token_weight=tw, chunk_size=7, **kw)
        return linear_policy_loss(xr, wr, labels, token_weight=tw, loss=cfg, inputs=inputs, chunk_size=7,
                                  **kw).loss

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = forward(xr, wr)
    (ref * up).backward()
    start = torch.randn(vocab, hidden, generator=g)
    acc = start.clone()
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = forward(xd, wd, weight_grad_accumulator=acc, upstream_grad=up, placeholder_weight_grad=True)
    assert float(loss.detach()) == float(ref.detach())
    err = _accumulated(*_accumulator_reference(x, w, labels, inputs, tw, entry, cfg, up), x, w, start, acc)
    assert err <= 1, err  # before any backward
    after_forward = acc.clone()
    (loss * up).backward()
    assert torch.equal(acc, after_forward)
    assert rel(xd.grad, xr.grad) < 1e-6
    assert wd.grad is not None and not wd.grad.any()  # the placeholder

    other = forward(x.clone().requires_grad_(), w.clone().requires_grad_(),
                    weight_grad_accumulator=start.clone(), upstream_grad=up)
    with pytest.raises(RuntimeError, match="upstream_grad: the loss was declared to receive"):
        (other * 2 * up).backward()
    with pytest.raises(ValueError, match="upstream_grad: declares the gradient"):
        forward(x, w, upstream_grad=1.0)
    with pytest.raises(TypeError, match="upstream_grad: expected a float or None"):
        forward(x, w, weight_grad_accumulator=start.clone(), upstream_grad=True)
    with pytest.raises(ValueError, match="upstream_grad: expected a finite value"):
        forward(x, w, weight_grad_accumulator=start.clone(), upstream_grad=float("inf"))
