"""Inputs at the edges, on the kernels' entry points (the third line review's findings): extreme
temperatures, ignored tokens with bad options, a declared loss's graph used twice or
differentiated again, a forward that fails halfway, ties at a truncation's edge."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mcore_hooks.kernels import (PolicyLoss, Truncation, VocabParallel, linear_cross_entropy,
                                 linear_logprob_entropy, linear_policy_loss)
from mcore_hooks.kernels.common.debug import debug_checks

pytestmark = pytest.mark.release_independent


def _data(n=24, h=16, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g),
            torch.randint(0, v, (n,), generator=g))


def _kept(labels, v):
    return torch.stack([labels, (labels + 1) % v, (labels + 7) % v], dim=1)


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "opted-out"])
@pytest.mark.parametrize("kind", ["vocabulary", "truncation", "nucleus", "kept_ids"])
def test_a_tiny_temperature_gives_finite_results_and_gradients(kind, invariant):
    """At temperature 2e-9 the scaled logits pass 3.4e8: the -1e30 that pads batch-invariant
    rows to 16 columns, set before the scaling, overflowed to -inf there and 0 * -inf made the
    entropy and both gradients NaN. The padding now comes after the scaling: everything is
    finite, and a one-hot distribution's entropy is 0."""
    x0, w0, y = _data()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    extra = {"vocabulary": {}, "truncation": {"truncation": Truncation(top_k=5)},
             "nucleus": {"truncation": Truncation(top_k=-1, top_p=0.9)},  # by a floor
             "kept_ids": {"kept_ids": _kept(y, w0.shape[0])}}[kind]
    r = linear_logprob_entropy(x, w, y, temperature=2e-9, batch_invariant=invariant, **extra)
    (r.logprob.sum() + r.entropy.sum()).backward()
    for name, t in (("logprob", r.logprob), ("entropy", r.entropy), ("dX", x.grad), ("dW", w.grad)):
        assert torch.isfinite(t).all(), name
    assert torch.equal(r.entropy, torch.zeros_like(r.entropy))  # exp underflows: one-hot rows


def _entry(name, x, w, y, t, invariant):
    if name == "linear_logprob_entropy":
        r = linear_logprob_entropy(x, w, y, temperature=t, batch_invariant=invariant)
        return r.logprob.sum() + r.entropy.sum(), r.logprob
    if name == "nucleus":  # a truncation without top-k: by a floor
        r = linear_logprob_entropy(x, w, y, temperature=t, batch_invariant=invariant,
                                   truncation=Truncation(top_k=-1, top_p=0.9))
        return r.logprob.sum() + r.entropy.sum(), r.logprob
    if name == "linear_cross_entropy":
        loss = linear_cross_entropy(x, w, y, temperature=t, batch_invariant=invariant)
        return loss, loss.reshape(1)
    n = y.shape[0]
    r = linear_policy_loss(x, w, y, temperature=t, batch_invariant=invariant, token_weight=torch.ones(n),
                           loss=PolicyLoss(entropy_coef=0.01),
                           inputs={"advantages": torch.linspace(-1, 1, n), "old_logprobs": -torch.ones(n)})
    return r.loss, r.logprob


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "opted-out"])
@pytest.mark.parametrize("entry", ["linear_logprob_entropy", "nucleus", "linear_cross_entropy", "linear_policy_loss"])
@pytest.mark.parametrize("bad", [0.0, math.nan, -1.0, math.inf])
def test_an_ignored_tokens_temperature_is_never_read(bad, entry, invariant):
    """A sample whose labels are all ``ignore_index`` (padding) with a per-token temperature of
    0, NaN, -1 or inf: unchecked (debug checks off, as on CUDA) its 0 * inf made every row of
    dW NaN. An ignored token adds exactly nothing: results and gradients are the bits of the
    same call with temperature 1 there; checked (the CPU's default), it is not refused."""
    x0, w0, y = _data()
    y[12:] = -100
    t_good = torch.linspace(0.5, 1.5, y.shape[0])
    t_bad = t_good.clone()
    t_bad[12:] = bad
    outs = []
    for t, checks in ((t_good, None), (t_bad, False), (t_bad, None)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with debug_checks(checks):
            total, values = _entry(entry, x, w, y, t, invariant)
        total.backward()
        outs.append((values.detach(), x.grad, w.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("wrt", ["x", "w"])
@pytest.mark.parametrize("case", ["cross-entropy", "policy-loss-op", "per-token-loss", "declared-upstream-grad"])
def test_differentiating_a_fused_gradient_again_raises_through_autograd_grad(case, wrt):
    """The fused losses' gradients are formed in the forward and hold no graph: a gradient
    penalty taken with ``torch.autograd.grad(penalty, x)`` found no path back to ``x`` and
    answered None (with ``allow_unused``: a Hessian-vector product read as zero). The node that
    raises is now on that path, as ``.backward()`` already found it."""
    from test_kernels import _double_backward_cases

    n, h, v, cases = _double_backward_cases()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = torch.randn(v, h, generator=g).requires_grad_()
    if case == "declared-upstream-grad" and wrt == "w":
        pytest.skip("the weight's gradient went into the accumulator: none to differentiate")
    loss = cases[case](x, w)
    target = {"x": x, "w": w}[wrt]
    grad, = torch.autograd.grad(loss, target, create_graph=True)
    penalty = grad.square().sum()
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(penalty, x, allow_unused=True, retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(penalty, w, allow_unused=True)


def _declared(x, w, y, acc, chunk_size=None, invariant=True, loss=None):
    n = y.shape[0]
    return linear_policy_loss(x, w, y, token_weight=torch.full((n,), 1.0 / n), chunk_size=chunk_size,
                              inputs={"advantages": torch.linspace(-1, 1, n)}, batch_invariant=invariant,
                              loss=loss or (lambda lp, ent, advantages: -advantages * lp),
                              weight_grad_accumulator=acc, upstream_grad=1.0, backend="torch").loss


def test_a_second_backward_of_a_declared_loss_raises():
    """With ``upstream_grad`` declared the weight's gradient went into the accumulator in the
    forward; a second backward (``retain_graph=True``) added dX again and nothing to dW, half
    a gradient, in silence. It raises now, before giving anything; the first is whole."""
    x0, w0, y = _data()
    acc = torch.zeros_like(w0)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = _declared(x, w, y, acc)
    loss.backward(retain_graph=True)
    dx, dw = x.grad.clone(), acc.clone()
    ref = torch.zeros_like(w0)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    _declared(xr, wr, y, ref).backward()
    assert torch.equal(dx, xr.grad) and torch.equal(dw, ref)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    assert torch.equal(x.grad, dx) and torch.equal(acc, dw)


class _FailsOnCall:
    """A per-token loss that raises on its ``k``-th call (one call per token chunk)."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def __call__(self, lp, ent, advantages):
        self.calls += 1
        if self.calls == self.k:
            raise MemoryError("simulated: out of memory in chunk %d" % self.k)
        return -advantages * lp


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "opted-out"])
def test_a_declared_forward_that_fails_halfway_leaves_no_partial_gradient(invariant):
    """A declared forward adds into ``main_grad`` chunk by chunk; failing on the 4th chunk left
    the first three added, silently, and a trainer that retries ends with a wrong gradient. Now
    the accumulator is set to NaN (nothing takes a partial sum back exactly) with a warning;
    failing before the first addition leaves it as it was, bit for bit."""
    x0, w0, y = _data()
    before = torch.randn(w0.shape, generator=torch.Generator().manual_seed(3))
    acc = before.clone()
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with pytest.warns(RuntimeWarning, match="now NaN"), pytest.raises(MemoryError, match="chunk 4"):
        _declared(x, w, y, acc, chunk_size=4, invariant=invariant, loss=_FailsOnCall(4))
    assert torch.isnan(acc).all()
    acc = before.clone()
    with pytest.raises(MemoryError, match="chunk 1"):
        _declared(x, w, y, acc, chunk_size=4, invariant=invariant, loss=_FailsOnCall(1))
    assert torch.equal(acc, before)


def test_every_failed_declared_forward_says_main_grad_is_nan():
    """Each failure sets the accumulator to NaN and costs a step its gradient: each says so, under
    Python's default warning filters too (which showed the first of them only, once per code
    location), as the unreceived-gradient warning does."""
    import warnings

    x0, w0, y = _data()
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for _ in range(3):
            acc = torch.zeros(w0.shape)
            with pytest.raises(MemoryError):
                _declared(x0.clone().requires_grad_(), w0.clone().requires_grad_(), y, acc, chunk_size=4,
                          loss=_FailsOnCall(4))
            assert torch.isnan(acc).all()
    assert sum("now NaN" in str(w.message) for w in seen) == 3, [str(w.message) for w in seen]


def test_sglang_keeps_a_label_tied_with_the_kth_value_in_place_of_a_tie():
    """SGLang's top-k keeps exactly ``k`` by rank; among logits tied at the ``k``-th its sort is
    unspecified. The engine sampled the label, so it was in its set: a label tied with the
    ``k``-th value (here three vocabulary rows equal, the label the highest id of them) is
    kept in place of a tie, ``k`` tokens, the same mass, its log-prob that of the set SGLang
    had, not added as a ``k + 1``-th (``label_outside`` False)."""
    g = torch.Generator().manual_seed(5)
    n, h, v, k = 8, 16, 40, 4
    w = torch.randn(v, h, generator=g)
    x = torch.randn(n, h, generator=g)
    logits = x @ w.t()
    for i in range(n):  # per token: its k-th to (k+2)-th logits made equal (equal weight rows)
        tied = logits[i].argsort(descending=True)[k - 1 : k + 2]
        label = int(tied.max())  # the highest id: last among the ties by id
        wi = w.clone()
        wi[tied] = w[tied[0]]
        r = linear_logprob_entropy(x[i : i + 1], wi, torch.tensor([label]),
                                   truncation=Truncation(top_k=k, engine="sglang"))
        li = (x[i : i + 1] @ wi.t())[0]
        top = li.argsort(descending=True)[: k - 1]
        top = top[li[top] > li[label]]  # strictly above the tie
        kept = torch.cat([top, torch.tensor([label])])
        want = torch.log_softmax(li[kept].double(), 0)[-1]
        assert not bool(r.label_outside[0])
        # float32 logits of size O(10) through a 4-term log-softmax: a few ulps of 10, ~1e-6
        assert abs(float(r.logprob[0]) - float(want)) <= 1e-5 * (1 + abs(float(want)))


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "opted-out"])
@pytest.mark.parametrize("fault", ["label-outside-its-row", "counted-empty-row"])
def test_unchecked_bad_kept_input_gives_nan_gradients_too(fault, invariant):
    """Replayed kept sets, debug checks off (as on CUDA): a label outside its row, or a counted
    token whose row is empty, gave a NaN loss but finite, plausible gradients (the token silently
    dropped from them), where an id outside the vocabulary gives NaN gradients. Now the
    token's gradients are NaN too: its row of dX, and dW; the other rows of dX are untouched.
    Checked (the CPU's default), both are refused, naming the token."""
    x0, w0, y = _data()
    n, v = y.shape[0], w0.shape[0]
    ids = _kept(y, v)
    if fault == "label-outside-its-row":
        ids[5] = torch.tensor([(int(y[5]) + 2) % v, (int(y[5]) + 3) % v, -1])
    else:
        ids[5] = -1
    kw = dict(token_weight=torch.ones(n), inputs={"advantages": torch.linspace(-1, 1, n)},
              loss=lambda lp, ent, advantages: -advantages * lp, kept_ids=ids, batch_invariant=invariant)
    with pytest.raises(ValueError, match="token 5"):
        linear_policy_loss(x0, w0, y, **kw)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with debug_checks(False):
        loss = linear_policy_loss(x, w, y, **kw).loss
    loss.backward()
    assert torch.isnan(loss)
    assert torch.isnan(x.grad[5]).all() and torch.isnan(w.grad).any()
    assert torch.isfinite(torch.cat([x.grad[:5], x.grad[6:]])).all()


@pytest.mark.parametrize("entry", ["linear_logprob_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("chunk_size", [21, 31, 100])
def test_a_chunk_size_that_does_not_divide_the_block_keeps_a_tokens_bits(chunk_size, entry):
    """Batch invariance for a given ``chunk_size`` (the torch backend's fixed-shape blocks, 64
    tokens on the CPU): a chunk that does not divide the block left a short last chunk, whose
    1-3-row products some CPU BLAS rounds differently, so a token's log-prob and dX row followed
    its place in the call. Every pass now cuts the block into equal chunks (a power of two, at
    most half of ``chunk_size``): a probe token's results are the same bits at every place."""
    g = torch.Generator().manual_seed(9)
    n, h, v = 70, 24, 56
    x0, w0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    y0 = torch.randint(0, v, (n,), generator=g)
    seen = []
    for place in (0, 15, 31, 47, 63, 69):  # block edges and the short-chunk rows
        order = torch.arange(n)
        order[0], order[place] = place, 0  # the probe (token 0) moved to `place`
        x = x0[order].clone().requires_grad_()
        w = w0.clone().requires_grad_()
        if entry == "linear_logprob_entropy":
            r = linear_logprob_entropy(x, w, y0[order], chunk_size=chunk_size, backend="torch")
            (r.logprob.sum() + r.entropy.sum()).backward()
            value = torch.stack([r.logprob[place], r.entropy[place]])
        else:
            tw = torch.zeros(n)
            tw[place] = 1.0  # the probe's loss alone, so its value is its own
            # a per-token weight picks the probe: its loss and its dX row
            value = linear_cross_entropy(x, w, y0[order], chunk_size=chunk_size, backend="torch",
                                         token_weight=tw).reshape(1)
            value.sum().backward()
        seen.append((value.detach(), x.grad[place].clone()))
    for value, row in seen[1:]:
        assert torch.equal(value, seen[0][0]) and torch.equal(row, seen[0][1])


@pytest.mark.parametrize("case", ["cross-entropy", "policy-loss-op", "per-token-loss", "declared-upstream-grad"])
def test_a_loss_divided_in_place_before_its_backward(case):
    """Megatron's schedule divides the loss a loss function returns in place
    (``output_tensor /= num_microbatches``) before its backward. The fused losses saved that
    very tensor (the double-backward guard's anchor) and the backward raised ("modified by an
    inplace operation"), on a 4-GPU training step at hidden 3584. The gradients are now those of
    the divided loss, as for any torch loss."""
    from mcore_hooks.kernels import linear_policy_loss
    from test_kernels import _double_backward_cases

    n, h, v, cases = _double_backward_cases()
    g = torch.Generator().manual_seed(13)
    x0, w0 = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    if case == "declared-upstream-grad":  # the gradient it gets must be the declared one: 1/4
        y = torch.randint(0, v, (n,), generator=g)

        def run(x, w, acc):
            return linear_policy_loss(x, w, y, token_weight=torch.ones(n), backend="torch",
                                      inputs={"advantages": torch.linspace(-1, 1, n),
                                              "old_logprobs": -torch.ones(n)},
                                      weight_grad_accumulator=acc, upstream_grad=0.25).loss
    else:
        def run(x, w, acc):
            return cases[case](x, w)
    grads = []
    for in_place in (False, True):
        x, w, acc = x0.clone().requires_grad_(), w0.clone().requires_grad_(), torch.zeros(v, h)
        loss = run(x, w, acc)
        if in_place:
            loss /= 4
        else:
            loss = loss / 4
        loss.backward()
        grads.append((x.grad, w.grad, acc))
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp-flag-one-rank"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_requests_truncation_is_its_own_beside_wider_ones(engine, sequence_parallel):
    """Per-request ``top_k``: the kept set's width is the call's largest, and the width chose
    how the kept logits were made (gathered rows up to ``V / 1024``, a dense product beyond):
    a request with ``top_k=8`` alone and beside ones with 20/40/60 differed (4.8e-7 in log-prob
    and entropy, every dX row; here dX's rows, 2.4e-7). Tokens are now grouped by their own
    width, each group's set as wide as its own options make it; also where the layout says
    sequence parallel on one rank (nothing gathered: the groups' rows are the call's)."""
    v, h, per = 65536, 16, 8  # alone: 33 kept columns, gathered (<= V / 1024); beside: 81, dense
    g = torch.Generator().manual_seed(21)
    w0 = torch.randn(v, h, generator=g) / 2
    x0 = torch.randn(4 * per, h, generator=g)
    y = torch.randint(0, v, (4 * per,), generator=g)

    def run(ks):
        n = per * len(ks)
        x, w = x0[:n].clone().requires_grad_(), w0.clone().requires_grad_()
        # the requests interleaved: a request's tokens need not be contiguous
        order = torch.arange(n).view(len(ks), per).t().reshape(-1)
        t = Truncation(top_k=torch.tensor(ks).repeat_interleave(per)[order], top_p=0.95, engine=engine)
        temperature = torch.linspace(0.6, 1.3, 4 * per)[:n][order]  # each token its own
        r = linear_logprob_entropy(x[order], w, y[:n][order], truncation=t, temperature=temperature,
                                   backend="torch", parallel=VocabParallel(sequence_parallel=sequence_parallel))
        (r.logprob.sum() + r.entropy.sum()).backward()
        mine = (order < per).nonzero().squeeze(1)  # the first request's tokens, in its order
        mine = mine[order[mine].argsort()]
        return (r.logprob[mine], r.entropy[mine], r.label_outside[mine], x.grad[:per])

    alone = run([8])
    for others in ([8, 20, 40, 60], [8, -1, 3], [8, 8]):
        beside = run(others)
        for name, a, b in zip(("logprob", "entropy", "label_outside", "dX"), alone, beside):
            assert torch.equal(a, b), f"{others} {name}: {(a.float() - b.float()).abs().max().item():.3g}"


def test_a_request_without_top_k_does_not_widen_the_others(monkeypatch):
    """``top_k=-1`` (vLLM's default: none) in one request made every token's kept set the
    whole vocabulary (``[tokens, V]`` kept logits for all). Its tokens are now a group of their
    own, whose top-p nucleus goes by a floor (no kept set made at all): the others' kept logits
    stay as narrow as their own options."""
    from mcore_hooks.kernels.passes import candidates_op
    from mcore_hooks.kernels.kept_sets import nucleus

    shapes, floors = [], []
    real, real_floor = candidates_op.logits_of, nucleus.renormalised

    def spy(hidden, weight, ids, p):
        shapes.append(tuple(ids.shape))
        return real(hidden, weight, ids, p)

    monkeypatch.setattr(candidates_op, "logits_of", spy)
    monkeypatch.setattr(nucleus, "renormalised", lambda h, *a, **k: floors.append(h.shape[0]) or real_floor(h, *a, **k))
    v, per = 512, 6
    x, w, y = _data(n=2 * per, h=8, v=v, seed=3)
    t = Truncation(top_k=[8] * per + [-1] * per, top_p=0.9)
    linear_logprob_entropy(x, w, y, truncation=t, backend="torch")
    assert shapes == [(per, 48)] and floors == [per], (shapes, floors)  # 8 + 16 ties + the label, to 16s


def test_a_groups_error_names_the_token_in_the_call():
    """An error in one width's group names the token's place in the call, not in its group."""
    g = torch.Generator().manual_seed(5)
    v, h = 64, 4
    w = torch.randn(v, h, generator=g)
    w[:10] = 10 * torch.ones(h)  # ten tied logits, the largest of every token
    x = torch.rand(4, h, generator=g) + 0.5
    y = torch.zeros(4, dtype=torch.long)
    t = Truncation(top_k=[20, 20, 20, 2], ties=1)  # the last: ties beyond its set of 3
    with pytest.raises(ValueError, match="truncation: token 3: its top_k 2"):
        linear_logprob_entropy(x, w, y, truncation=t, backend="torch")


def test_a_truncation_that_keeps_everything_takes_the_full_distribution(monkeypatch):
    """vLLM's defaults (no top-k, ``top_p = 1``, ``min_p = 0``) keep the whole vocabulary: those
    tokens take the statistics pass (no ``[tokens, V]`` kept set), equal to the kept-set path
    to float32 rounding and to the plain full-vocabulary call bit for bit; beside a truncated
    request, only that request's tokens build a kept set."""
    from mcore_hooks.kernels.passes import candidates_op

    v, per = 300, 5
    x0, w0, y = _data(n=2 * per, h=8, v=v, seed=9)
    full = linear_logprob_entropy(x0, w0, y, backend="torch", temperature=0.8)
    shapes = []
    real = candidates_op.logits_of
    monkeypatch.setattr(candidates_op, "logits_of",
                        lambda h, w, ids, p: shapes.append(tuple(ids.shape)) or real(h, w, ids, p))
    r = linear_logprob_entropy(x0, w0, y, backend="torch", temperature=0.8, truncation=Truncation(top_k=-1))
    assert shapes == [] and not r.label_outside.any()
    for name in ("logprob", "entropy", "logz", "label_is_argmax"):
        assert torch.equal(getattr(r, name), getattr(full, name)), name
    mixed = linear_logprob_entropy(x0, w0, y, backend="torch", temperature=0.8,
                                   truncation=Truncation(top_k=[0] * per + [7] * per, top_p=[1.0] * per + [0.9] * per))
    assert shapes == [(per, 48)], shapes  # the truncated request's: 7 + 16 ties to 32, + the label, to 48
    assert torch.equal(mixed.logprob[:per], full.logprob[:per])
    # the kept-set path over the whole vocabulary (the width given on the device) agrees
    wide = linear_logprob_entropy(x0, w0, y, backend="torch", temperature=0.8,
                                  truncation=Truncation(top_k=torch.zeros(2 * per, dtype=torch.long), max_top_k=v))
    # each path within tolerances.logprob_error of float64 (its first-order bound, times C):
    # so the two within twice that
    from tolerances import C, logit_grad_reference, logprob_error

    bound = logprob_error(logit_grad_reference(x0, w0, y, lambda lp, ent: lp, temperature=0.8), x0, w0)
    assert ((wide.logprob - full.logprob).abs().double() <= 2 * C * bound.squeeze(1)).all()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_nucleus_without_top_k_cut_inside_ties_keeps_what_the_gathered_set_keeps(engine):
    """A request without top-k goes by a floor (the set's smallest logit and the last id kept
    among its ties), not by gathering ``[tokens, V]``. Where top-p cuts inside a group of tied
    logits, the floor keeps the same ids as the gathered set's rule (ties by ascending id; the
    label ahead of its ties for SGLang): here against ``top_k = V - 20``, which min-p makes a
    no-op, so both name one set; log-probs, entropies and gradients to float32 rounding,
    ``label_outside`` equal."""
    g = torch.Generator().manual_seed(8)
    n, h, v = 6, 16, 40
    w0 = torch.randn(v, h, generator=g)
    x = torch.randn(n, h, generator=g)
    for i in range(n):
        li = x[i] @ w0.t()
        tied = li.argsort(descending=True)[1:4]  # ranks 1-3 made equal (equal weight rows)
        w = w0.clone()
        w[tied] = w0[tied[0]]
        p = torch.softmax((x[i] @ w.t()).double(), 0)
        top = p.argsort(descending=True)
        p_top, p_tie = float(p[top[0]]), float(p[tied[0]])
        min_p = 0.5 * (p_tie + float(p[top[4]])) / p_top  # the ties kept, the 36 below them dropped
        # the boundary inside the tie, two of three kept (vLLM's top-p renormalises min-p's
        # survivors, SGLang's does not)
        top_p = (p_top + 1.5 * p_tie) / ((p_top + 3 * p_tie) if engine == "vllm" else 1.0)
        label = torch.tensor([int(tied.max())])  # the highest id of the ties
        out = []
        for k in (-1, v - 20):
            xg, wg = x[i : i + 1].clone().requires_grad_(), w.clone().requires_grad_()
            t = Truncation(top_k=k, top_p=top_p, min_p=min_p, engine=engine, ties=1)
            r = linear_logprob_entropy(xg, wg, label, truncation=t, backend="torch")
            (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
            out.append((r.logprob, r.entropy, r.label_outside, xg.grad, wg.grad))
        assert torch.equal(out[0][2], out[1][2]), i
        assert bool(out[0][2][0]) == (engine == "vllm")  # SGLang's label in place of a tie
        for a, b in zip(out[0][:2] + out[0][3:], out[1][:2] + out[1][3:]):
            # float32 logits of size O(10) over a few kept terms: a few ulps of 10
            assert torch.allclose(a, b, rtol=0, atol=1e-5), (i, (a - b).abs().max())


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_nucleus_by_floor_is_batch_invariant(engine):
    """A token's nucleus (no top-k) results and dX row are the same bits alone and in a call
    of 70 (past the CPU's 64-token block), at another place: the floor and the passes over
    it run on the fixed-shape blocks."""
    g = torch.Generator().manual_seed(4)
    v, h = 300, 16
    w0 = torch.randn(v, h, generator=g) / 2
    x0 = torch.randn(70, h, generator=g)
    y = torch.randint(0, v, (70,), generator=g)

    def run(rows):
        x, w = x0[rows].clone().requires_grad_(), w0.clone().requires_grad_()
        t = Truncation(top_k=-1, top_p=0.9, min_p=0.01, engine=engine)
        r = linear_logprob_entropy(x, w, y[rows], truncation=t, backend="torch")
        (r.logprob.sum() + r.entropy.sum()).backward()
        return r.logprob, r.entropy, r.label_outside, x.grad

    alone = run(torch.arange(60, 65))
    beside = run(torch.arange(70).roll(5))  # tokens 60-64 at places 65-69
    for name, a, b in zip(("logprob", "entropy", "label_outside", "dX"), alone, beside):
        assert torch.equal(a, b[65:70]), name


# --------------------------------------------------------------------------- per-request options
# (issue 57, the fourth review: items 2-5)

_TRUNCATION_BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])


@pytest.mark.parametrize("backend", _TRUNCATION_BACKENDS)
def test_a_request_with_vllms_defaults_is_the_same_bits_beside_a_whole_vocabulary_top_p(backend):
    """A request with vLLM's defaults (``top_k=-1, top_p=1, min_p=0``) keeps the whole
    vocabulary: alone it takes the plain statistics pass. Beside a request with ``top_k=-1,
    top_p=0.9`` both had the vocabulary's width, no groups formed, and it moved to the floor
    route's passes (|d log-prob| 9.5e-7 on the Triton backend). Keeping everything is now a group
    of its own: the same bits whoever its neighbours are (top-p without top-k, top-k 50, none)."""
    per, h, v = 6, 16, 300
    g = torch.Generator().manual_seed(14)
    dtype = torch.float32 if backend == "torch" else torch.float16
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else Triton's interpreter
    w0 = (torch.randn(v, h, generator=g) / 2).to(dev, dtype)
    x0 = torch.randn(2 * per, h, generator=g).to(dev, dtype)
    y = torch.randint(0, v, (2 * per,), generator=g).to(dev)

    def run(other_k, other_p):
        n = per if other_k is None else 2 * per
        x, w = x0[:n].clone().requires_grad_(), w0.clone().requires_grad_()
        ks, ps = [-1] * per, [1.0] * per
        if other_k is not None:
            ks, ps = ks + [other_k] * per, ps + [other_p] * per
        t = Truncation(top_k=ks, top_p=ps, min_p=0.0)
        r = linear_logprob_entropy(x, w, y[:n], truncation=t, backend=backend, temperature=0.8)
        (r.logprob.sum() + 0.5 * r.entropy.sum()).backward()
        return r.logprob[:per], r.entropy[:per], r.label_outside[:per], x.grad[:per]

    alone = run(None, None)
    for other in ((-1, 0.9), (50, 0.9), (-1, 1.0)):
        beside = run(*other)
        for name, a, b in zip(("logprob", "entropy", "label_outside", "dX"), alone, beside):
            assert torch.equal(a, b), f"{other} {name}: {(a.float() - b.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("top_k", [[8] * 4 + [20] * 4, [8] * 4 + [-1] * 4, [8] * 8], ids=["two widths", "a width and none", "one width"])
@pytest.mark.parametrize("bad", ["top_p list of 10", "min_p tensor of 12", "top_p list of 2"])
def test_per_request_options_of_another_length_are_refused_whatever_the_widths(top_k, bad):
    """With two widths a ``top_p`` of 10 values or a ``min_p`` tensor of 12 for 8 tokens was used
    silently (their first 8), and 2 values gave a bare IndexError; with one width each was
    refused. Now each is refused, named, before anything runs, whatever the widths."""
    x, w, y = _data(n=8, h=8, v=64, seed=2)
    name, value = {
        "top_p list of 10": ("top_p", [0.9] * 10),
        "min_p tensor of 12": ("min_p", torch.full((12,), 0.05)),
        "top_p list of 2": ("top_p", [0.9, 0.8]),
    }[bad]
    t = Truncation(top_k=top_k, **{name: value})
    with pytest.raises(ValueError, match=rf"truncation\.{name}: expected one value or 8 \(one per token\)"):
        linear_logprob_entropy(x, w, y, truncation=t, backend="torch")


def test_the_weights_placeholder_is_one_whatever_the_grouping():
    """``placeholder_weight_grad=True`` hands the weight a zero-stride zero gradient so that
    Megatron DDP's hooks run. Per-request widths form groups, each of which handed the weight its
    own placeholder, and autograd added them into a dense ``[V, H]`` zeros tensor (the weight's
    size) before the weight's hooks saw it. Now one group hands it: the gradient the hooks get is
    one element of storage, whatever the grouping."""
    x0, w0, y = _data(n=8, h=16, v=200, seed=6)
    for top_k in ([8] * 8, [8] * 4 + [20] * 4, [8] * 3 + [20] * 3 + [-1] * 2):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        handed = []
        w.register_hook(lambda g: handed.append(g))  # what autograd hands the weight, summed
        acc = torch.zeros(w.shape)
        r = linear_logprob_entropy(x, w, y, truncation=Truncation(top_k=top_k, top_p=[0.9] * 8),
                                   weight_grad_accumulator=acc, placeholder_weight_grad=True, backend="torch")
        (r.logprob.sum() + r.entropy.sum()).backward()
        assert len(handed) == 1 and handed[0].stride() == (0, 0), (top_k, handed[0].stride())
        assert handed[0].untyped_storage().nbytes() == handed[0].element_size(), top_k
        assert not bool(handed[0].any()) and bool(acc.abs().sum() > 0)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.slow
def test_a_whole_vocabulary_top_p_is_batch_invariant_at_every_call_size(engine):
    """At V = 151936 the floor pass sorts 18 rows at a time. SGLang's rule sums each row's
    probabilities (its normaliser), and a one-row step (a call of 1, 19, 37, ... tokens) summed
    with another split than an 18-row step: a top-p cut moved (here token 61 of 64 on this
    project's CPU, its floor 2.6e-6 apart). Every step's rows now have one shape: a token's
    results and dX row are the same bits alone, in calls of 19 and 37 tokens, and in one of 64."""
    g = torch.Generator().manual_seed(0)
    v, h, n = 151936, 16, 64
    w0 = torch.randn(v, h, generator=g) / 16  # a high-entropy head: top-p cuts deep in the row
    x0 = torch.randn(n, h, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    t = Truncation(top_k=-1, top_p=0.9, engine=engine)

    def run(rows):
        x = x0[rows].clone().requires_grad_()
        r = linear_logprob_entropy(x, w0, y[rows], truncation=t, backend="torch")
        (r.logprob.sum() + r.entropy.sum()).backward()
        return r.logprob.detach(), r.entropy.detach(), r.label_outside, x.grad

    full = run(torch.arange(n))
    for rows in (torch.tensor([61]), torch.arange(n - 19, n), torch.arange(n - 37, n)):
        part = run(rows)
        for name, a, b in zip(("logprob", "entropy", "label_outside", "dX"), part, full):
            assert torch.equal(a, b[rows]), f"{len(rows)} tokens: {name}"
