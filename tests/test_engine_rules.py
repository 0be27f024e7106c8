"""The rollout engines' truncation rules, as their released code writes them (vLLM 0.33.0's
``apply_top_k_top_p_pytorch`` after its Model Runner V2 ``min_p``; SGLang 0.5.23's
``top_k_top_p_min_p_sampling_from_probs_torch``), written here from reading that code, against
``Truncation(engine=...)``: the kept set bit for bit on the same float32 logits, on rows built
to sit on the rules' edges (ties at the k-th value from bf16-rounded logits, all-equal and
near-flat rows, very peaked rows, top_p near 1, min-p with top-p, temperatures other than 1,
per-request options mixed in one batch); then through the kernels and a processor, values and
gradients against float64 over the engine's set; and the inputs that would give plausible wrong
numbers (a label outside the set, an empty row, an id past the vocabulary, a mask with no
``kept_set``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mcore_hooks import LogprobEntropyProcessor, PolicyLossProcessor, debug_checks
from mcore_hooks.kernels import Truncation, linear_logprob_entropy, linear_policy_loss
from mcore_hooks.kernels.kept_sets import truncation
from mcore_hooks.rollout import sampling_mask_ids
from mcore_hooks.testing import hook_keywords
from tolerances import C, grad_bounds, logit_grad_reference, logprob_error, ratio

F32 = torch.float32


# --------------------------------------------------------------------------- the engines' rules


def vllm_keep(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33.0, Model Runner V2 with its PyTorch top-k/top-p, per row: min-p on the scaled
    float32 logits (``l < max + log(min_p)`` -> -inf, float32; rows with ``min_p == 0`` untouched),
    then top-k (sorted ascending, the ``k``-th largest at index ``V - k``; values strictly below it
    -> -inf, so its ties stay; ``k <= 0`` or ``> V`` normalised to ``V``), then top-p on the
    softmax of what is left (float32 cumulative sum, ascending; dropped where ``<= 1 - p`` in
    float32; the last always kept; rows with ``p == 1`` untouched: the rule is applied per
    request). Returns the finite entries."""
    v = logits.shape[1]
    l = logits.clone()
    thr = l.amax(1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    l = torch.where((min_p > 0).unsqueeze(1) & (l < thr), -math.inf, l)
    s, idx = l.sort(dim=-1, descending=False)
    kk = torch.where((k <= 0) | (k > v), v, k)
    kth = s.gather(1, (v - kk).unsqueeze(1))
    s = s.masked_fill(s < kth, -math.inf)
    cum = torch.cumsum(s.softmax(dim=-1), dim=-1)
    drop = (cum <= (1 - p).unsqueeze(1)) & (p < 1).unsqueeze(1)
    drop[:, -1] = False
    s = s.masked_fill(drop, -math.inf)
    return torch.isfinite(torch.empty_like(l).scatter(1, idx, s))


def sglang_keep(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """SGLang 0.5.23's PyTorch backend, per row, on the full vocabulary's float32 probabilities:
    sorted descending (its sort is unstable: ties here by ascending id), the cumulative sum taken
    before filtering; ranks ``>= k`` zeroed (exactly ``k``); zeroed where ``cumsum - p_i > top_p``
    (the unrenormalised mass before the token); min-p last, zeroed where ``p_i < p_max *
    min_p``; kept: the positive weights."""
    v = probs.shape[1]
    order = torch.argsort(-probs, dim=1, stable=True)  # ties: ascending id
    ps = probs.gather(1, order)
    cum = torch.cumsum(ps, dim=1)
    kk = torch.where((k <= 0) | (k > v), v, k)
    w = torch.where(torch.arange(v).unsqueeze(0) >= kk.unsqueeze(1), 0.0, ps)
    w = torch.where((cum - ps) > p.unsqueeze(1), 0.0, w)
    w = torch.where(w < w[:, :1] * min_p.unsqueeze(1), 0.0, w)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, w > 0)


def _ours(logits, k, p, min_p, engine, width=None, ties=16):
    """``Truncation``'s rule on the same logits, given as the kernels' candidates (the ``width``
    largest; all of them by default), and the full vocabulary's statistics."""
    n, v = logits.shape
    width = v if width is None else width
    values, ids = logits.topk(width, dim=1)
    m = logits.amax(1)
    log_s = torch.log(torch.exp(logits - m.unsqueeze(1)).sum(1))
    t = Truncation(top_k=k, top_p=p, min_p=min_p, engine=engine, ties=ties)
    opts = t._per_token(n, logits.device, v)
    kept, overflow = truncation.truncate(values, ids, opts, engine, m, log_s, v)
    keep = torch.zeros(n, v, dtype=torch.long).scatter_add_(1, kept.clamp(min=0), (kept >= 0).long()) > 0
    probs = torch.exp(logits - m.unsqueeze(1)) / torch.exp(log_s).unsqueeze(1)
    return keep, overflow, probs


def _edge_rows(seed: int, v: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [R, V] whose rows sit on the rules' edges, with per-request options for each."""
    g = torch.Generator().manual_seed(seed)
    rows, ks, ps, mins = [], [], [], []

    def add(row, k, p, mn):
        rows.append(row.to(F32))
        ks.append(k)
        ps.append(p)
        mins.append(mn)

    base = torch.randn(v, generator=g) * 3
    # ties at the k-th value: bf16-rounded logits (8 bits of mantissa tie often)
    for k in (3, 5, 8, 12):
        add((torch.randn(v, generator=g) * 2).bfloat16().float(), k, 0.9, 0.0)
    tied = base.clone()
    tied[torch.randperm(v, generator=g)[:6]] = tied.max() - 1.0  # six tied around the 2nd-7th
    add(tied, 4, 1.0, 0.0)
    add(tied, 4, 0.95, 0.05)
    add(torch.zeros(v), 5, 1.0, 0.0)  # all equal
    add(torch.zeros(v), 5, 0.7, 0.0)
    add(torch.randn(v, generator=g) * 1e-3, 10, 0.8, 0.0)  # near-flat
    peaked = torch.randn(v, generator=g)
    peaked[7] = 40.0  # very peaked
    add(peaked, 10, 0.9, 0.1)
    add(peaked, 2, 0.999, 0.0)
    add(base, 20, 0.999, 0.0)  # top_p near 1
    add(base, 20, 0.99999, 0.0)
    add(base, 30, 0.9, 0.02)  # min-p with top-p
    add(base * 0.25, 0, 0.85, 0.0)  # no top-k (<= 0)
    add(base * 4, v + 5, 0.6, 0.0)  # no top-k (> V)
    add(base / 0.7, 12, 0.95, 0.03)  # another temperature
    add(base, 1, 1.0, 0.0)
    return torch.stack(rows), torch.tensor(ks), torch.tensor(ps, dtype=F32), torch.tensor(mins, dtype=F32)


def _same_choice(keep: torch.Tensor, want: torch.Tensor, logits: torch.Tensor) -> None:
    """The same kept set, up to which of exactly tied logits a cut takes: vLLM's top-p and
    SGLang's top-k sort with torch's unstable sort, so among equal values the engine's choice is
    unspecified (``Truncation`` keeps the lowest ids): per row, the same number kept and the
    same kept values."""
    for row, (a, b) in enumerate(zip(keep, want)):
        got, exp = logits[row][a].sort().values, logits[row][b].sort().values
        assert torch.equal(got, exp), (row, int(a.sum()), int(b.sum()))


@pytest.mark.parametrize("seed", range(4))
def test_the_vllm_rule_keeps_exactly_what_vllms_pytorch_code_keeps(seed):
    logits, k, p, min_p = _edge_rows(seed)
    keep, overflow, _ = _ours(logits, k, p, min_p, "vllm")
    _same_choice(keep, vllm_keep(logits, k, p, min_p), logits)
    assert not overflow.any()
    # ties of the k-th value kept: rows wider than top_k, the all-equal row whole
    widths = keep.sum(1)
    assert widths[4] > 4 and widths[6] == logits.shape[1]  # 6 tied at the 4th value: wider; all equal


@pytest.mark.parametrize("seed", range(4))
def test_the_sglang_rule_keeps_exactly_what_sglangs_pytorch_code_keeps(seed):
    logits, k, p, min_p = _edge_rows(seed)
    keep, _, probs = _ours(logits, k, p, min_p, "sglang")
    _same_choice(keep, sglang_keep(probs, k, p, min_p), logits)
    kk = torch.where((k <= 0) | (k > logits.shape[1]), logits.shape[1], k)
    assert torch.all(keep.sum(1) <= kk)  # exactly k at most, by rank, ties or not


def test_the_engines_differ_where_their_code_does():
    """vLLM keeps every tie of the k-th value and SGLang exactly k; vLLM's top-p takes ``1 -
    float32(p)`` in float32: 2998 of 3000 flat tokens at p = 0.999 (``float32(1 - p)`` keeps
    2997); SGLang's top-p is on the unrenormalised probabilities."""
    tied = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    one = dict(p=torch.tensor([1.0]), min_p=torch.tensor([0.0]))
    v_keep, _, _ = _ours(tied, torch.tensor([2]), one["p"], one["min_p"], "vllm")
    s_keep, _, _ = _ours(tied, torch.tensor([2]), one["p"], one["min_p"], "sglang")
    assert v_keep.sum() == 4 and s_keep.sum() == 2 and s_keep[0, :2].all()
    flat = torch.zeros(1, 3000)
    keep, _, _ = _ours(flat, torch.tensor([3000]), torch.tensor([0.999]), torch.tensor([0.0]), "vllm")
    assert int(keep.sum()) == int(vllm_keep(flat, torch.tensor([3000]), torch.tensor([0.999]),
                                            torch.tensor([0.0])).sum()) == 2998
    # top-k 2 then top-p 0.45: vLLM renormalises over the two kept (0.5 / 0.5: the first alone
    # reaches 0.45), SGLang does not (the second's mass before it, 0.4 of the whole, is within
    # 0.45: both stay)
    probs = torch.tensor([[0.4, 0.4, 0.1, 0.1]]).log()
    v2, _, _ = _ours(probs, torch.tensor([2]), torch.tensor([0.45]), torch.tensor([0.0]), "vllm")
    s2, _, _ = _ours(probs, torch.tensor([2]), torch.tensor([0.45]), torch.tensor([0.0]), "sglang")
    assert v2.sum() == 1 and s2.sum() == 2


def test_ties_past_the_width_are_refused_or_nan_never_cut():
    """vLLM's rule keeps every tie of the k-th value; where the kernels' gathered width (top_k +
    ``ties``) cannot hold them, the token is refused where values are checked, else NaN."""
    logits = torch.zeros(2, 40)
    logits[1] = torch.randn(40, generator=torch.Generator().manual_seed(0))
    keep, overflow, _ = _ours(logits, torch.tensor([5, 5]), torch.ones(2), torch.zeros(2), "vllm",
                              width=9, ties=4)
    assert overflow.tolist() == [True, False]
    x = torch.zeros(3, 4)  # all-equal rows: 40 tied logits
    w = torch.randn(40, 4)
    y = torch.tensor([1, 2, 3])
    with debug_checks(True), pytest.raises(ValueError, match="tied with its 5-th largest.* width 9; raise Truncation.ties"):
        linear_logprob_entropy(x, w, y, truncation=Truncation(top_k=5, ties=4))
    with debug_checks(False):
        r = linear_logprob_entropy(x, w, y, truncation=Truncation(top_k=5, ties=4))
    assert torch.isnan(r.logprob).all()
    whole = linear_logprob_entropy(x, w, y, truncation=Truncation(top_k=5, ties=40))
    assert torch.allclose(whole.logprob, torch.full((3,), -math.log(40)))  # the whole vocabulary


# --------------------------------------------------------------------------- through the kernels and a processor


N, H, V = 24, 16, 48


def _data(seed=0, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    return x, w, labels


@pytest.mark.parametrize("invariant", [False, True], ids=["opted-out", "batch-invariant"])
@pytest.mark.parametrize("none", [True, False], ids=["some-without-top-k", "narrow"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_per_token_options_through_the_kernels_match_float64_over_the_engines_set(engine, none, invariant):
    """Per-token top-k / top-p / min-p and temperatures, mixed in one call: the log-prob, entropy
    and gradients of the distribution renormalised over the engine's set (the label added where
    the rule dropped it, and flagged), against float64. With some tokens without top-k the
    candidates are the whole vocabulary; narrow, the largest top-k (plus vLLM's room for ties)
    only; batch-invariant, padded to aligned columns."""
    x, w, labels = _data(1)
    g = torch.Generator().manual_seed(2)
    k = torch.randint(1, 20, (N,), generator=g)
    if none:
        k[0], k[1] = 0, V + 3
    p = torch.rand(N, generator=g) * 0.5 + 0.5
    p[2] = 1.0
    min_p = torch.where(torch.rand(N, generator=g) > 0.5, 0.05, 0.0)
    temp = torch.linspace(0.6, 1.3, N)
    t = Truncation(top_k=k, top_p=p, min_p=min_p, engine=engine)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    r = linear_logprob_entropy(xg, wg, labels, truncation=t, temperature=temp, batch_invariant=invariant)
    (r.logprob.sum() - 0.3 * r.entropy.sum()).backward()
    # the engine's set on the kernels' own float32 logits (the rule is exact on them)
    logits = (x @ w.t()) * (1.0 / temp).unsqueeze(1)
    keep = (vllm_keep(logits, k, p, min_p) if engine == "vllm" else
            sglang_keep(torch.softmax(logits, 1), k, p, min_p))
    valid = labels != -100
    outside = valid & ~keep[torch.arange(N), labels.clamp(min=0)]
    assert torch.equal(r.label_outside, outside)
    keep[valid, labels[valid]] = True
    ref = logit_grad_reference(x, w, labels, lambda lp, ent: lp - 0.3 * ent, temperature=temp, keep=keep)
    lp_ref = torch.where(valid, ref.logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    assert ratio(r.logprob, lp_ref, C * logprob_error(ref, x, w).squeeze(1)) <= 1
    b = grad_bounds(ref, x, w, F32)
    assert ratio(xg.grad, ref.dx, b.dx) <= 1 and ratio(wg.grad, ref.dw, b.dw) <= 1


def test_per_request_options_through_a_processor_are_the_kernels_per_token():
    """A processor takes one option per sample (``[b]``), spread over each sample's tokens."""
    s, b = 6, 3
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(s, b, H, generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    t = Truncation(top_k=[3, 0, 9], top_p=[0.8, 1.0, 0.95], min_p=torch.tensor([0.0, 0.1, 0.02]),
                   engine="sglang")
    out = LogprobEntropyProcessor(kept_set=t, temperature=torch.tensor([0.7, 1.0, 1.2]))(
        **hook_keywords(hidden, layer, labels=labels))
    per_token = Truncation(top_k=torch.tensor([3, 0, 9]).repeat(s), top_p=torch.tensor([0.8, 1.0, 0.95]).repeat(s),
                           min_p=torch.tensor([0.0, 0.1, 0.02]).repeat(s), engine="sglang")
    want = linear_logprob_entropy(hidden.reshape(-1, H), layer.weight, labels.t().reshape(-1),
                                  truncation=per_token, temperature=torch.tensor([0.7, 1.0, 1.2]).repeat(s))
    assert torch.equal(out["logprobs"], want.logprob.view(s, b).t())
    assert torch.equal(out["label_outside"], want.label_outside.view(s, b).t())
    with pytest.raises(ValueError, match="kept_set.top_p: expected one per sample"):
        LogprobEntropyProcessor(kept_set=Truncation(top_k=3, top_p=[0.9, 0.8]))(
            **hook_keywords(hidden, layer, labels=labels))


def test_truncation_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="top_k: required, e.g. Truncation"):
        Truncation(top_p=0.9)
    for bad, match in ((dict(top_k=True), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_k=5, top_p=0.0), "top_p"),
                       (dict(top_k=5, top_p=1.5), "top_p"), (dict(top_k=5, min_p=-0.1), "min_p"),
                       (dict(top_k=5, min_p=math.nan), "min_p"), (dict(top_k=5, engine="trt"), "engine"),
                       (dict(top_k=[3, 0.5]), "top_k"), (dict(top_k=5, top_p=[0.9, 2.0]), "top_p"),
                       (dict(top_k=5, ties=-1), "ties")):
        with pytest.raises(ValueError, match=match):
            Truncation(**bad)
    assert Truncation(top_k=0)._width(100) == 100  # none: the vocabulary
    x, w, labels = _data()
    with pytest.raises(ValueError, match="one value or 24"):
        linear_logprob_entropy(x, w, labels, truncation=Truncation(top_k=[3, 4]))


# --------------------------------------------------------------------------- plausible wrong numbers


def test_a_label_outside_a_replayed_set_is_flagged_and_nan_unchecked():
    x, w, labels = _data(5)
    ids = torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 1) % V], 1)
    ids[7, 0] = (labels[7] + 2) % V  # token 7's label is not in its set
    with debug_checks(True), pytest.raises(ValueError, match="label of token 7"):
        linear_logprob_entropy(x, w, labels, kept_ids=ids)
    with debug_checks(False):
        r = linear_logprob_entropy(x, w, labels, kept_ids=ids)
    assert r.label_outside.nonzero().squeeze(1).tolist() == [7]
    assert torch.isnan(r.logprob[7]) and torch.isfinite(r.logprob[torch.arange(N) != 7]).all()


def test_a_counted_token_with_an_empty_row_is_refused_or_nan():
    """A short or shifted mask: an empty row (all -1) at a token the loss counts. The policy
    loss used to take its log-prob as 0 (a term -A * clip(exp(-old)) with no gradient)."""
    x, w, labels = _data(6)
    ids = torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 1) % V], 1)
    ids[9] = -1
    tw = torch.ones(N)
    inputs = {"old_logprobs": -torch.rand(N), "advantages": torch.randn(N)}
    with debug_checks(True), pytest.raises(ValueError, match="token 9 counts in the loss .* empty"):
        linear_policy_loss(x, w, labels, token_weight=tw, inputs=inputs, kept_ids=ids)
    with debug_checks(False):
        assert torch.isnan(linear_policy_loss(x, w, labels, token_weight=tw, inputs=inputs, kept_ids=ids).loss)
    tw[9] = 0.0  # not counted (a prompt position): no term
    assert torch.isfinite(linear_policy_loss(x, w, labels, token_weight=tw, inputs=inputs, kept_ids=ids).loss)
    # through a processor, by its loss mask
    s, b = 4, 2
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(s, b, H)
    lab = torch.randint(0, V, (b, s))
    mask = torch.stack([lab, (lab + 1) % V], -1)
    mask[1, 2] = -1
    kw = hook_keywords(hidden, layer, labels=lab, loss_mask=torch.ones(b, s), context={"sampling_mask": mask})
    with debug_checks(True), pytest.raises(ValueError, match=r"position \(1, 2\) counts"):
        LogprobEntropyProcessor(kept_set="replay")(**kw)
    kw["loss_mask"] = torch.ones(b, s).index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(0.0))
    assert LogprobEntropyProcessor(kept_set="replay")(**kw)["logprobs"][1, 2] == 0


def test_ids_past_the_vocabulary_give_nan_unchecked():
    """With value checks off (the CUDA default) an id no rank owns counted as a logit of 0: a
    kept-set log-prob of -0.02 came out -1.41. Such a token is NaN now, as a bad label is."""
    x, w, labels = _data(7)
    ids = torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 1) % V], 1)
    ids[4, 1] = V + 10
    sel = torch.randint(0, V, (N, 3))
    sel[5, 2] = V
    with debug_checks(True):
        for kw in (dict(kept_ids=ids), dict(selected_ids=sel)):
            with pytest.raises(ValueError, match=r"ids must be in \[0, 48\)"):
                linear_logprob_entropy(x, w, labels, **kw)
    with debug_checks(False):
        r = linear_logprob_entropy(x, w, labels, kept_ids=ids)
        s = linear_logprob_entropy(x, w, labels, selected_ids=sel)
    assert torch.isnan(r.logprob[4]) and torch.isfinite(torch.cat([r.logprob[:4], r.logprob[5:]])).all()
    assert torch.isnan(s.selected[5]).all() and torch.isfinite(s.selected[6:]).all()


def test_a_sampling_mask_without_kept_set_is_refused():
    """Forgetting ``kept_set="replay"`` would hide exactly the mismatch the mask is for."""
    s, b = 4, 2
    layer = torch.nn.Linear(H, V, bias=False)
    lab = torch.randint(0, V, (b, s))
    ctx = {"old_logprobs": torch.zeros(b, s), "advantages": torch.ones(b, s),
           "sampling_mask": torch.stack([lab, (lab + 1) % V], -1)}
    for proc in (PolicyLossProcessor(), LogprobEntropyProcessor()):
        with pytest.raises(ValueError, match="sampling_mask'\\]: given, but this processor's kept_set is None"):
            proc(**hook_keywords(torch.randn(s, b, H), layer, labels=lab, context=ctx))


def test_vllms_one_position_csr_is_a_row():
    """vLLM (0.30.0+) ships each step's mask as ``SamplingMaskLists(token_ids)`` with ``offsets``
    None; its ``to_nested_list()`` is ``[token_ids]``."""
    one = SimpleNamespace(token_ids=np.array([9, 2, 5], dtype=np.int32), offsets=None)
    assert sampling_mask_ids(one).tolist() == [[2, 5, 9]]
    many = SimpleNamespace(token_ids=np.array([9, 2, 5], dtype=np.int32), offsets=np.array([0, 1, 3]))
    assert sampling_mask_ids(many, width=3).tolist() == [[9, -1, -1], [2, 5, -1]]


def test_a_width_that_cannot_hold_a_tokens_top_k_is_refused_or_nan_never_short():
    """A device top-k with a ``max_top_k`` below some token's (or a token without top-k): that
    token's set would be cut short; refused where checked, NaN otherwise, for both engines."""
    x, w, labels = _data(8)
    k = torch.full((N,), 3)
    k[5] = 0  # none: the whole vocabulary, which a width of 3 (+ ties) cannot hold
    for engine in ("vllm", "sglang"):
        t = Truncation(top_k=k, max_top_k=3, ties=0, engine=engine)
        with debug_checks(True), pytest.raises(ValueError, match="token 5: its top_k 48"):
            linear_logprob_entropy(x, w, labels, truncation=t)
        with debug_checks(False):
            r = linear_logprob_entropy(x, w, labels, truncation=t)
        assert torch.isnan(r.logprob[5]) and torch.isfinite(r.logprob[torch.arange(N) != 5]).all()


def test_an_out_of_vocabulary_id_at_an_ignored_position_is_no_input():
    """Padding ids at positions that do not count (ignored labels: a prompt) hold anything: they
    neither raise nor make a gradient NaN."""
    x, w, labels = _data(9)
    ids = torch.stack([labels.clamp(min=0), (labels.clamp(min=0) + 1) % V], 1)
    ids[3, 1] = V + 7  # token 3's label is -100
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with debug_checks(False):
        r = linear_logprob_entropy(xg, wg, labels, kept_ids=ids)
    r.logprob.sum().backward()
    assert torch.isfinite(xg.grad).all() and torch.isfinite(wg.grad).all()


def test_integer_per_request_options_in_a_processor():
    """``[0, 0]`` is a min-p per request too: spread as floats, not refused at the call."""
    s, b = 4, 2
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(s, b, H)
    labels = torch.randint(0, V, (b, s))
    out = LogprobEntropyProcessor(kept_set=Truncation(top_k=[5, 6], top_p=[1, 1], min_p=[0, 0]))(
        **hook_keywords(hidden, layer, labels=labels))
    assert torch.isfinite(out["logprobs"]).all()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_samples_truncation_through_a_processor_is_its_own_beside_wider_ones(engine):
    """A processor's per-sample ``top_k`` (unpacked ``[b, s]``) stays on the host, one per
    token, so the kernels group tokens by their own width: a sample's log-probs, entropies and
    hidden-state gradient are the same bits alone and beside samples with wider top-k (the
    width decides how the kept logits are made; at V = 65536, 33 columns gather, 81 do not)."""
    s, v, h = 5, 65536, 8
    g = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(v, h, generator=g) / 2)
    hidden0 = torch.randn(s, 3, h, generator=g)
    labels0 = torch.randint(0, v, (3, s), generator=g)

    def run(ks):
        b = len(ks)
        hidden = hidden0[:, :b].clone().requires_grad_()
        proc = LogprobEntropyProcessor(kept_set=Truncation(top_k=ks, top_p=0.9, engine=engine))
        out = proc(**hook_keywords(hidden, layer, labels=labels0[:b]))
        (out["logprobs"].sum() + out["entropy"].sum()).backward()
        return out["logprobs"][0], out["entropy"][0], hidden.grad[:, 0]

    alone, beside = run([8]), run([8, 60, -1])
    for name, a, b in zip(("logprobs", "entropy", "dX"), alone, beside):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item():.3g}"
