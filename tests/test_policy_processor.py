"""PolicyLossProcessor through real Megatron Core models, against the stock logits path followed
by verl's loss, and under context parallelism."""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import PolicyLossProcessor, hooked_class
from mcore_hooks.kernels import PolicyLoss
from mcore_hooks.testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    hook_keywords,
    packed_sequence_slices,
    run_on_ranks,
    stock_model_class,
    supports_packed_sequences,
    tiny_batch,
)
from ddp_like import ddp_like
from test_policy_loss import _verl_agg, _verl_terms

pytestmark = pytest.mark.usefixtures("mp1")

CFG = PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)


def _inputs(shape, g, lp=None):
    """Per-token inputs [b, s]: old log-probs near the current ones where those are known."""
    base = lp.detach() if lp is not None else -torch.rand(shape, generator=g) * 5
    return {
        "old_logprobs": base + 0.3 * (torch.rand(shape, generator=g) - 0.5),
        "advantages": torch.randn(shape, generator=g),
        "ref_logprobs": base + 0.2 * torch.randn(shape, generator=g),
    }


def _stock_policy_loss(stock, batch, inputs, mode, temperature=1.0, sequences=None):
    """The stock path: full logits from the stock model, log_softmax, verl's loss and
    aggregation over sequences (rows, or the packed sequences' slices)."""
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    logits = stock(**kwargs).float() / temperature  # [b, s, V]
    logp = torch.log_softmax(logits, -1)
    labels = batch["labels"]
    valid = labels != -100
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    terms = _verl_terms(lp, ent, inputs["old_logprobs"], inputs["advantages"], inputs["ref_logprobs"], CFG)
    mask = valid.float() * batch.get("loss_mask", torch.ones_like(lp))
    if sequences is None:
        return _verl_agg(torch.where(mask > 0, terms, 0.0), mask, mode), lp
    rows = [torch.where(mask[0, sl] > 0, terms[0, sl], 0.0) for sl in sequences]
    width = max(sl.stop - sl.start for sl in sequences)
    pad = lambda ts: torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in ts])
    return _verl_agg(pad(rows), pad([mask[0, sl] for sl in sequences]), mode), lp


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_class", available_model_classes())
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_matches_the_stock_logits_path(model_class, mode):
    cfg = TinyModelConfig(model_class=model_class, tied=False)
    stock = build_tiny_model(cfg)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))
    batch = tiny_batch(cfg)
    with torch.no_grad():  # old log-probs near the current ones: ratios across the clip bounds
        lp0 = _stock_policy_loss(stock, batch, _inputs(batch["labels"].shape, torch.Generator()), mode)[1]
    inputs = _inputs(batch["labels"].shape, torch.Generator().manual_seed(3), lp0)
    ref, lp = _stock_policy_loss(stock, batch, inputs, mode)
    ref.backward()
    out = model(**batch, output_processor=PolicyLossProcessor(loss=CFG, aggregation=mode),
                output_processor_context=inputs)
    out["loss"].backward()
    torch.testing.assert_close(out["loss"], ref, rtol=1e-5, atol=1e-6)
    valid = batch["labels"] != -100
    torch.testing.assert_close(out["logprobs"], torch.where(valid, lp, 0.0).detach(), rtol=1e-5, atol=1e-6)
    ours, theirs = _grads(model), _grads(stock)
    assert ours.keys() == theirs.keys()
    for name in ours:
        err = (ours[name] - theirs[name]).norm() / theirs[name].norm().clamp(min=1e-30)
        assert err < 1e-5, (name, float(err))


def test_packed_sequences_are_the_sequences():
    cfg = TinyModelConfig(tied=False)
    if not supports_packed_sequences(cfg.model_class):
        pytest.skip("no packed sequences on this class")
    stock = build_tiny_model(cfg)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))
    batch = tiny_batch(cfg, packed=True)
    seqs = packed_sequence_slices(batch)
    temps = torch.tensor([0.7, 1.3, 1.0, 0.5][: len(seqs)])
    per_token_t = torch.cat([temps[i].expand(sl.stop - sl.start) for i, sl in enumerate(seqs)])
    inputs = _inputs(batch["labels"].shape, torch.Generator().manual_seed(5))
    mode = "seq-mean-token-mean"
    ref, _ = _stock_policy_loss(stock, batch, inputs, mode, per_token_t.view(1, -1, 1), seqs)
    ref.backward()
    out = model(**batch, output_processor=PolicyLossProcessor(loss=CFG, aggregation=mode, temperature=temps,
                                                              as_tuple=True),
                output_processor_context=inputs)
    assert isinstance(out, tuple) and len(out) == 3
    out[0].backward()
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-6)
    ours, theirs = _grads(model), _grads(stock)
    for name in ours:
        err = (ours[name] - theirs[name]).norm() / theirs[name].norm().clamp(min=1e-30)
        assert err < 1e-5, (name, float(err))


def _cp_check(mode: str):
    """CP=2: each rank's value is the unsplit run's, its hidden-state gradient the unsplit
    gradient's slice, and the weight gradients summed over the group the unsplit one."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    g = torch.Generator().manual_seed(9)
    s, b, hidden_size, vocab = 8, 2, 16, 40
    torch.manual_seed(0)
    layer = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(s, b, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, 1] = -100
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    mask[:, : s // 2] = 0.0  # rank 0 counts far fewer tokens than rank 1
    mask[1, 1] = 1.0
    inputs = _inputs((b, s), g)

    def run(h, part, cp_group):
        h = h.clone().requires_grad_()
        layer.zero_grad()
        out = PolicyLossProcessor(loss=CFG, aggregation=mode)(**hook_keywords(
            h, layer, labels=labels[:, part], loss_mask=mask[:, part], cp_group=cp_group,
            context={k: v[:, part] for k, v in inputs.items()},
        ))
        out["loss"].backward()
        return out["loss"].detach(), h.grad, layer.weight.grad.clone()

    part = slice(rank * s // 2, (rank + 1) * s // 2)
    local, dh, dw = run(hidden[part], part, group)
    dist.all_reduce(dw, group=group)
    full, dh_full, dw_full = run(hidden, slice(None), None)
    return local, full, dh, dh_full[part], dw, dw_full


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_context_parallel_is_the_whole_sequences(mode):
    for local, full, dh, dh_ref, dw, dw_ref in run_on_ranks(_cp_check, 2, mode, tp=1, cp=2):
        tol = dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(local, full, **tol)
        torch.testing.assert_close(dh, dh_ref, **tol)
        torch.testing.assert_close(dw, dw_ref, **tol)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="aggregation: expected one of"):
        PolicyLossProcessor(aggregation="mean")
    with pytest.raises(TypeError, match="loss: expected a PolicyLoss or a per-token function"):
        PolicyLossProcessor(loss=0.2)
    with pytest.raises(TypeError, match="takes keyword arguments only"):
        PolicyLossProcessor(CFG)
    layer = torch.nn.Linear(8, 20, bias=False)
    h = torch.randn(4, 2, 8)
    labels = torch.randint(0, 20, (2, 4))
    with pytest.raises(ValueError, match="output_processor_context: expected a mapping"):
        PolicyLossProcessor()(**hook_keywords(h, layer, labels=labels))
    bad = {"old_logprobs": torch.zeros(2, 4), "advantages": torch.zeros(4, 2)}
    with pytest.raises(ValueError, match=r"output_processor_context\['advantages'\]: expected a \[b, s\]"):
        PolicyLossProcessor()(**hook_keywords(h, layer, labels=labels, context=bad))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("make", [
    lambda: PolicyLossProcessor(loss=CFG),
    lambda: PolicyLossProcessor(loss=CFG, upstream_grad=0.5),
    lambda: LinearCEProcessorSum(),
    lambda: LinearCEProcessorSum(upstream_grad=0.5),
    lambda: LogprobEntropyProcessorSum(),
], ids=["policy", "policy-declared", "linear-ce-sum", "linear-ce-sum-declared", "logprob-entropy"])
def test_gradient_accumulation_fusion_adds_into_main_grad(tied, make):
    """config.gradient_accumulation_fusion: the output weight's gradient goes into main_grad in
    fp32 (two micro-batches accumulate), the weight is marked grad_added_to_main_grad, and DDP's
    hook adds nothing twice; a tied weight's other gradient (the embedding's) still arrives.
    With the upstream gradient declared (0.5, what the step's backward brings), the same sums,
    the weight's added in the forward."""
    import types

    g = torch.Generator().manual_seed(12)
    s, b, h, v = 6, 2, 8, 40
    torch.manual_seed(0)
    layer = torch.nn.Linear(h, v, bias=False)
    ids = torch.randint(0, v, (b, s), generator=g)

    def step(fused, seed):
        gg = torch.Generator().manual_seed(seed)
        hidden = torch.randn(s, b, h, generator=gg, requires_grad=True)
        labels = torch.randint(0, v, (b, s), generator=gg)
        kw = hook_keywords(hidden, layer, labels=labels, context=_inputs((b, s), gg))
        kw["config"] = types.SimpleNamespace(context_parallel_size=1, gradient_accumulation_fusion=fused)
        out = make()(**kw)
        loss = out["loss"] if isinstance(out, dict) else out
        if tied:  # the embedding's use of the same weight
            loss = loss + (layer.weight[ids] ** 2).sum() * 1e-3
        (loss * 0.5).backward()  # as a schedule divides by the micro-batch count
        return hidden.grad

    results = {}
    for fused in (False, True):
        handle = ddp_like(layer.weight, zero_out_wgrad=tied)
        dh = [step(fused, seed) for seed in (1, 2)]
        results[fused] = (layer.weight.main_grad.clone(), dh, layer.weight.grad_added_to_main_grad)
        handle.remove()
    (ref, ref_dh, ref_flag), (got, got_dh, flag) = results[False], results[True]
    assert not ref_flag and flag
    assert ((got - ref).norm() / ref.norm()) < 1e-6
    for a, r in zip(got_dh, ref_dh):
        assert ((a - r).norm() / r.norm()) < 1e-6
    assert layer.weight.grad is None


class LinearCEProcessorSum:
    def __init__(self, **options):
        self.options = options

    def __call__(self, **kw):
        from mcore_hooks import LinearCEProcessor

        return LinearCEProcessor(reduction="sum", **self.options)(**kw)


def test_a_declared_upstream_gradient_is_checked():
    """upstream_grad: checked at construction, and against the gradient the backward brings (a
    different one is an error, never a wrong main_grad; on the CPU it raises at once)."""
    import types

    with pytest.raises(TypeError, match="upstream_grad: expected a float or None"):
        PolicyLossProcessor(upstream_grad="0.5")
    with pytest.raises(ValueError, match="upstream_grad: expected a finite value"):
        PolicyLossProcessor(upstream_grad=float("nan"))
    g = torch.Generator().manual_seed(3)
    s, b, h, v = 5, 2, 8, 30
    layer = torch.nn.Linear(h, v, bias=False)
    handle = ddp_like(layer.weight, zero_out_wgrad=False)
    hidden = torch.randn(s, b, h, generator=g, requires_grad=True)
    kw = hook_keywords(hidden, layer, labels=torch.randint(0, v, (b, s), generator=g),
                       context=_inputs((b, s), g))
    kw["config"] = types.SimpleNamespace(context_parallel_size=1, gradient_accumulation_fusion=True)
    out = PolicyLossProcessor(loss=CFG, upstream_grad=0.25)(**kw)
    assert layer.weight.main_grad.abs().sum() > 0  # added in the forward
    with pytest.raises(RuntimeError, match="upstream_grad: the loss was declared to receive the gradient 0.25 .* but received 0.5:"):
        (out["loss"] * 0.5).backward()
    handle.remove()


class LogprobEntropyProcessorSum:
    def __call__(self, **kw):
        from mcore_hooks import LogprobEntropyProcessor

        out = LogprobEntropyProcessor()(**kw)
        return out["logprobs"].sum() + 0.1 * out["entropy"].sum()


def test_mtp_depths_add_into_main_grad_too():
    """With the main head's gradient in main_grad (the weight marked), the MTP depths' fused
    loss must put theirs there as well: DDP's hook skips .grad once the weight is marked."""
    import types

    from mcore_hooks.mtp import MTPDepth, fused_mtp_loss

    g = torch.Generator().manual_seed(2)
    s, b, h, v = 5, 2, 8, 30
    layer = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(s, b, h, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)

    def depth(fused):
        config = types.SimpleNamespace(gradient_accumulation_fusion=fused)
        return MTPDepth(hidden, labels, layer.weight, layer, 1.0, 0, 1, config, None, 0, 1, 0, False)

    fused_mtp_loss(depth(False)).loss.sum().backward()
    ref = layer.weight.grad.clone()
    layer.weight.grad = None
    handle = ddp_like(layer.weight, zero_out_wgrad=False)
    fused_mtp_loss(depth(True)).loss.sum().backward()
    handle.remove()
    assert layer.weight.grad_added_to_main_grad
    assert ((layer.weight.main_grad - ref).norm() / ref.norm()) < 1e-6


def _handoff_nodes(root) -> set:
    """The main_grad hand-off nodes the graph below ``root`` holds."""
    seen, stack, found = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_MainGradHandoffBackward":
            found.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


@pytest.mark.parametrize("declared", [None, 1.0], ids=["in-backward", "declared"])
def test_one_placeholder_per_forward_for_the_head_and_every_mtp_depth(declared):
    """The main head (the policy loss; with its gradient declared, the fused op, which saves no
    weight) and two MTP depths route the same weight into main_grad inside one forward's
    ``shared_routes`` block (the MTP hook's): one hand-off node (one [V/tp, h] placeholder per
    backward, as Megatron's own layer makes), not one per call for autograd to sum. Two
    micro-batches interleaved as 1F1B does (forward, forward, backward, backward): each forward
    has its own node, nothing is carried from one to the next, DDP's hook runs once per
    backward, and main_grad is the sum of both, as without the route."""
    import types

    from mcore_hooks import main_grad
    from mcore_hooks.mtp import MTPDepth, fused_mtp_loss

    s, b, h, v = 5, 2, 8, 30
    torch.manual_seed(0)
    layer = torch.nn.Linear(h, v, bias=False)

    def forward(fused, seed):
        gg = torch.Generator().manual_seed(seed)
        config = types.SimpleNamespace(context_parallel_size=1, gradient_accumulation_fusion=fused)
        hidden = torch.randn(s, b, h, generator=gg, requires_grad=True)
        labels = torch.randint(0, v, (b, s), generator=gg)
        kw = hook_keywords(hidden, layer, labels=labels, context=_inputs((b, s), gg))
        kw["config"] = config
        with main_grad.shared_routes():
            loss = PolicyLossProcessor(loss=CFG, upstream_grad=declared if fused else None)(**kw)["loss"]
            for depth in range(2):
                d = MTPDepth(hidden * (depth + 2), labels, layer.weight, layer, 1.0, 0, 1, config, None,
                             0, 1, depth, False)
                loss = loss + fused_mtp_loss(d).loss.sum() * 0.1
        return loss

    results = {}
    for fused in (False, True):
        handle = ddp_like(layer.weight, zero_out_wgrad=False)
        first, second = forward(fused, 1), forward(fused, 2)
        if fused:
            nodes = _handoff_nodes(first.grad_fn), _handoff_nodes(second.grad_fn)
            assert len(nodes[0]) == len(nodes[1]) == 1 and nodes[0] != nodes[1]
        first.backward()
        assert handle.calls == 1 and (not fused or layer.weight.grad_added_to_main_grad)
        second.backward()
        assert handle.calls == 2
        results[fused] = layer.weight.main_grad.clone()
        handle.remove()
    assert ((results[True] - results[False]).norm() / results[False].norm()) < 1e-6


def test_the_hand_off_adds_a_gradient_from_anything_else_into_main_grad():
    """Whatever else uses the routed weight (not a kernel, which adds into main_grad itself)
    hands the hand-off a real gradient: it goes into main_grad too, never dropped."""
    import types

    from mcore_hooks import main_grad

    layer = torch.nn.Linear(4, 6, bias=False)
    handle = ddp_like(layer.weight, zero_out_wgrad=False)
    config = types.SimpleNamespace(gradient_accumulation_fusion=True)
    routed, _ = main_grad.main_grad_route(layer.weight, config)
    (routed ** 2).sum().backward()
    handle.remove()
    torch.testing.assert_close(layer.weight.main_grad, 2 * layer.weight.detach())
    assert layer.weight.grad_added_to_main_grad and layer.weight.grad is None
