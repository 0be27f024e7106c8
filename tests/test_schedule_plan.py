"""The processor through ``build_schedule_plan`` and the combined-1F1B post-process node (CPU).

The plan is run as Megatron's scheduler runs it (``TransformerModelChunkSchedulePlan.run``,
forward then backward), with the CUDA streams and events it orders its nodes with stood in for
(:func:`mcore_hooks.testing.schedule_plan_on_cpu`). Native on Megatron Core 0.18+, backported on
0.14-0.17; 0.13 has no plan.

Upstream's plan never applies the decoder's final norm when the last layer is dense (0.16+; the
combined-1F1B schedule is for MoE models, whose last layer applies it), so comparisons between
the plan and ``forward`` use models without a final norm; comparisons between the stock plan
and the plan with a processor use the stock model as it is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_hooks import (
    OUTPUT_PROCESSOR_KEYWORDS,
    DefaultProcessor,
    PostprocessContext,
    compat,
    enable_output_processor,
    hooked_class,
)
from mcore_hooks.processors import FusedLogprobProcessor, LinearCEProcessor, LogprobEntropyProcessor
from mcore_hooks.testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    run_on_ranks,
    schedule_plan_on_cpu,
    stock_model_class,
    tiny_batch,
)

GPT = stock_model_class("gpt")
HAS_PLAN = hasattr(GPT, "build_schedule_plan")
NATIVE = compat.has_native_hook(GPT)
pytestmark = pytest.mark.usefixtures("mp1")
needs_plan = pytest.mark.skipif(not HAS_PLAN, reason="no combined-1F1B schedule plan before Megatron Core 0.14")


def _plan_class():
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

    return TransformerModelChunkSchedulePlan


def _weighting(out: Any, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    if isinstance(out, tuple):
        return tuple(torch.rand(o.shape, generator=g) for o in out)
    return torch.rand(out.shape, generator=g)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_plan(model, batch: dict, **hook) -> tuple[Any, dict]:
    """Build the plan, run its forward and backward as the scheduler does; output and grads."""
    plan_cls = _plan_class()
    model.zero_grad(set_to_none=True)
    with schedule_plan_on_cpu():
        plan = model.build_schedule_plan(**batch, **hook)
        out = plan_cls.run(plan, None)
        out = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
        plan_cls.run(None, plan, b_grad=_weighting(out))
    return out, _grads(model)


def run_forward(model, batch: dict, **hook) -> tuple[Any, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **hook)
    w = _weighting(out)
    if isinstance(out, tuple):
        sum((o.float() * g).sum() for o, g in zip(out, w)).backward()
        out = tuple(o.detach() for o in out)
    else:
        (out.float() * w).sum().backward()
        out = out.detach()
    return out, _grads(model)


def _pair(cfg):
    stock = build_tiny_model(cfg)
    hooked = build_tiny_model(cfg, model_cls=hooked_class(GPT))
    return stock, hooked


def _without_final_norm(model):
    model.decoder.final_layernorm = None  # see the module docstring
    return model


class Recorder:
    def __init__(self, inner=None):
        self.inner = inner or DefaultProcessor()
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return self.inner(**kwargs)


def _assert_equal(a, b, exact: bool):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y, exact)
    elif exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _assert_grads(a: dict, b: dict, exact: bool):
    assert a.keys() == b.keys() and a
    for name in a:
        _assert_equal(a[name], b[name], exact)


# --------------------------------------------------------------------------- the plan's seam


@needs_plan
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_processor_none_leaves_the_plan_bitwise_stock(tied, packed):
    cfg = TinyModelConfig(tied=tied)
    stock, hooked = _pair(cfg)
    batch = tiny_batch(cfg, packed=packed)
    ref = run_plan(stock, batch)
    got = run_plan(hooked, batch, output_processor=None)
    _assert_equal(got[0], ref[0], exact=True)
    _assert_grads(got[1], ref[1], exact=True)
    # and the default processor through the plan computes what the stock node computes
    dflt = run_plan(hooked, batch, output_processor=DefaultProcessor())
    _assert_equal(dflt[0], ref[0], exact=True)
    _assert_grads(dflt[1], ref[1], exact=True)


def _compare_keywords(via_plan: dict, via_forward: dict, batch: dict) -> None:
    assert tuple(via_plan) == tuple(via_forward) == OUTPUT_PROCESSOR_KEYWORDS
    for k in OUTPUT_PROCESSOR_KEYWORDS:
        a, b = via_plan[k], via_forward[k]
        if torch.is_tensor(b):
            assert torch.is_tensor(a) and a.shape == b.shape and torch.equal(a, b), k
        elif k in ("compute_language_model_loss", "scale_logits"):
            assert getattr(a, "__func__", a) is getattr(b, "__func__", b), k
        else:
            assert a is b, k
    for k in ("labels", "loss_mask", "input_ids", "position_ids", "attention_mask", "packed_seq_params"):
        assert via_plan[k] is batch.get(k), k  # the tensors the caller passed, as forward's


@needs_plan
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_node_calls_the_processor_with_the_keywords_forward_passes(tied, packed):
    cfg = TinyModelConfig(tied=tied)
    model = _without_final_norm(build_tiny_model(cfg, model_cls=hooked_class(GPT)))
    batch = tiny_batch(cfg, packed=packed)
    context = {"micro-batch": 0}
    a, b = Recorder(), Recorder()
    via_plan = run_plan(model, batch, output_processor=a, output_processor_context=context)
    via_forward = run_forward(model, batch, output_processor=b, output_processor_context=context)
    assert len(a.calls) == len(b.calls) == 1
    _compare_keywords(a.calls[0], b.calls[0], batch)
    _assert_equal(via_plan[0], via_forward[0], exact=False)
    _assert_grads(via_plan[1], via_forward[1], exact=False)


@needs_plan
@pytest.mark.parametrize(
    "make",
    [
        lambda: LogprobEntropyProcessor(as_tuple=True),
        FusedLogprobProcessor,
        LinearCEProcessor,
        lambda: LinearCEProcessor(reduction="sum"),
        lambda: LinearCEProcessor(reduction="mean"),
    ],
    ids=["logprob+entropy tuple", "logprob", "ce", "ce sum", "ce mean"],
)
def test_bundled_processors_through_the_plan_equal_forward(make):
    cfg = TinyModelConfig(tied=False)
    model = _without_final_norm(build_tiny_model(cfg, model_cls=hooked_class(GPT)))
    batch = tiny_batch(cfg)
    via_plan = run_plan(model, batch, output_processor=make())
    via_forward = run_forward(model, batch, output_processor=make())
    _assert_equal(via_plan[0], via_forward[0], exact=False)
    _assert_grads(via_plan[1], via_forward[1], exact=False)


@needs_plan
def test_each_micro_batch_plan_sees_its_own_context():
    cfg = TinyModelConfig()
    model = build_tiny_model(cfg, model_cls=hooked_class(GPT))
    rec = Recorder()
    plan_cls = _plan_class()
    with schedule_plan_on_cpu():
        plans = [
            model.build_schedule_plan(**tiny_batch(cfg, seed=i), output_processor=rec, output_processor_context=i)
            for i in range(3)
        ]
        outs = [plan_cls.run(plan, None) for plan in plans]
        for plan, out in zip(plans, outs):
            plan_cls.run(None, plan, b_grad=torch.ones_like(out))
    assert [c["context"] for c in rec.calls] == [0, 1, 2]
    assert [plan.state.output_processor_context for plan in plans] == [0, 1, 2]


@needs_plan
@pytest.mark.skipif(NATIVE, reason="0.18+: the plan is upstream's own (called through), and so is its error")
@pytest.mark.parametrize(
    "result, says",
    [
        ({"logprobs": 1, "entropy": 2}, r"returned a dict with keys \['entropy', 'logprobs'\]"),
        (None, "returned None"),
        ("odd", "returned a builtins.str"),
        ((), "returned a tuple of nothing"),
    ],
)
def test_results_the_plan_cannot_take_give_a_clear_error(result, says):
    cfg = TinyModelConfig()
    model = build_tiny_model(cfg, model_cls=hooked_class(GPT))

    def odd_processor(**kwargs):
        return result

    with pytest.raises(TypeError, match=f"output_processor .*odd_processor.* {says} under the combined-1F1B schedule plan"):
        run_plan(model, tiny_batch(cfg), output_processor=odd_processor)
    with pytest.raises(TypeError, match=r"returned a dict .*LogprobEntropyProcessor\(as_tuple=True\)"):
        run_plan(model, tiny_batch(cfg), output_processor=LogprobEntropyProcessor())


def test_classes_without_a_plan_say_so():
    for name in available_model_classes():
        cfg = TinyModelConfig(model_class=name)
        model = enable_output_processor(build_tiny_model(cfg))
        cls = stock_model_class(name)
        if hasattr(cls, "build_schedule_plan"):
            continue
        if compat.has_native_hook(cls):  # upstream's hook without a plan (upstream/0001)
            # left as it is (nothing upstream lacks is asked for): upstream's own AttributeError;
            # asked for the combined-1F1B schedule, it is switched and says which plan is missing
            assert type(model) is cls
            with pytest.raises(AttributeError, match="build_schedule_plan"):
                model.build_schedule_plan(**tiny_batch(cfg), output_processor=DefaultProcessor())
            model.config.overlap_moe_expert_parallel_comm = True
            enable_output_processor(model)
            with pytest.raises(NotImplementedError, match="no combined-1F1B schedule plan in any"):
                model.build_schedule_plan(**tiny_batch(cfg), output_processor=DefaultProcessor())
            continue
        if name == "gpt":
            match = "GPTModel.build_schedule_plan arrived in 0.14"
        else:
            match = "no combined-1F1B schedule plan in any Megatron Core release .*PR #4942"
        with pytest.raises(NotImplementedError, match=match):
            model.build_schedule_plan(**tiny_batch(cfg), output_processor=DefaultProcessor())


# --------------------------------------------------------------------------- TP=2, sequence parallel


def _tp2_plan(sp: bool):
    cfg = TinyModelConfig(tied=False, sequence_parallel=sp)
    model = _without_final_norm(build_tiny_model(cfg, model_cls=hooked_class(GPT)))
    batch = tiny_batch(cfg)
    a, b = Recorder(LogprobEntropyProcessor(as_tuple=True)), Recorder(LogprobEntropyProcessor(as_tuple=True))
    via_plan = run_plan(model, batch, output_processor=a)
    via_forward = run_forward(model, batch, output_processor=b)
    shapes = (tuple(a.calls[0]["hidden_states"].shape), tuple(b.calls[0]["hidden_states"].shape))
    sharded = PostprocessContext.from_kwargs(a.calls[0]).sequence_parallel
    _compare_keywords(a.calls[0], b.calls[0], batch)
    _assert_equal(via_plan[0], via_forward[0], exact=False)
    _assert_grads(via_plan[1], via_forward[1], exact=False)
    return shapes, sharded


@needs_plan
def test_tensor_parallel_2_with_and_without_sequence_parallel():
    for sp in (False, True):
        for (plan_shape, forward_shape), sharded in run_on_ranks(_tp2_plan, 2, sp):
            assert plan_shape == forward_shape and sharded is sp
            assert plan_shape[0] == (16 // 2 if sp else 16)


def test_tuple_forms_are_documented():
    """Every bundled processor has a form the plan takes: a tensor, or as_tuple=True."""
    assert "as_tuple" in (LogprobEntropyProcessor.__doc__ or "")
    for cls in (FusedLogprobProcessor, LinearCEProcessor):
        assert "tensor" in (cls.__doc__ or "").lower()


# --------------------------------------------------------------------------- outputs the loss did not use


class _LogprobAndNone:
    """A processor returning ``(logprobs, None)``: upstream passes the None to the loss."""

    def __call__(self, **kwargs):
        return FusedLogprobProcessor()(**kwargs), None


def _policy_context(batch):
    from mcore_hooks.kernels import PolicyLoss  # noqa: F401  (the processor's default loss)

    shape = batch["labels"].shape
    g = torch.Generator().manual_seed(4)
    return {"old_logprobs": -torch.rand(shape, generator=g) * 4, "advantages": torch.randn(shape, generator=g)}


def _partial_plan(model, batch, used, **hook):
    """The plan as the scheduler runs it when the loss used only the outputs marked in ``used``:
    the loss node hands back None for the others (unused, detached or None outputs)."""
    plan_cls = _plan_class()
    model.zero_grad(set_to_none=True)
    with schedule_plan_on_cpu():
        plan = model.build_schedule_plan(**batch, **hook)
        out = plan_cls.run(plan, None)
        w = _weighting(tuple(o for o in out if o is not None))
        it = iter(w)
        grads = tuple(next(it) if o is not None and u else (None if o is None else None) for o, u in zip(out, used))
        plan_cls.run(None, plan, b_grad=grads)
    return tuple(o.detach() if o is not None else None for o in out), _grads(model)


def _partial_forward(model, batch, used, **hook):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **hook)
    w = _weighting(tuple(o for o in out if o is not None))
    terms = [(o.float() * g).sum() for o, g, u in zip((o for o in out if o is not None), w, used) if u]
    sum(terms).backward()
    return tuple(o.detach() if o is not None else None for o in out), _grads(model)


@needs_plan
@pytest.mark.parametrize("which", ["logprob-entropy", "policy", "verl", "with-none"])
def test_tuple_outputs_the_loss_did_not_use(which):
    """The usual GRPO set-up under the plan: entropy logged but not in the loss, a policy loss's
    detached metrics, a None entry. Upstream's post-process backward rejected each; now the
    gradients are those of the loss over the outputs it used."""
    from mcore_hooks import PolicyLossProcessor
    from mcore_hooks.integrations.verl import VerlFusedProcessor

    cfg = TinyModelConfig(tied=False)
    model = _without_final_norm(build_tiny_model(cfg))
    # Megatron's schedules run the plan only with this set: on 0.18+ it is what has
    # enable_output_processor switch a native model's class for the plan's backward
    model.config.overlap_moe_expert_parallel_comm = True
    model = enable_output_processor(model)
    batch = tiny_batch(cfg)
    hook: dict = {}
    if which == "logprob-entropy":
        make, used = (lambda: LogprobEntropyProcessor(as_tuple=True)), (True, False)
    elif which == "policy":
        make, used = (lambda: PolicyLossProcessor(as_tuple=True)), (True, False, False)
        hook["output_processor_context"] = _policy_context(batch)
    elif which == "verl":
        make, used = (lambda: VerlFusedProcessor(as_tuple=True)), (True, False)
    else:
        make, used = _LogprobAndNone, (True, False)
    got, got_grads = _partial_plan(model, batch, used, output_processor=make(), **hook)
    ref, ref_grads = _partial_forward(model, batch, used, output_processor=make(), **hook)
    assert len(got) == len(used)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _assert_grads(got_grads, ref_grads, exact=False)
