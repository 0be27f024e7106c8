"""Where two options meet: each combination exact, or refused before any state changes."""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch

from mcore_hooks import (
    DefaultProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
    PolicyLossProcessor,
    enable_output_processor,
)
from mcore_hooks.testing import TinyModelConfig, build_tiny_model, hook_keywords, tiny_batch

pytestmark = pytest.mark.usefixtures("mp1")


def _deferring_model():
    """A tiny GPTModel whose output layer defers its weight gradient to the pipeline flush, as
    Megatron builds it with ``defer_embedding_wgrad_compute`` on the last stage (set after
    construction: the config refuses the flag without pipeline parallelism)."""
    cfg = TinyModelConfig(tied=False)
    model = enable_output_processor(build_tiny_model(cfg))
    # the output layer's own copy: the local spec's other ColumnParallelLinear layers have no
    # buffers (Megatron's real runs use Transformer Engine's layers there)
    model.output_layer.config = copy.copy(model.config)
    model.output_layer.config.defer_embedding_wgrad_compute = True
    model.output_layer.embedding_activation_buffer = []
    model.output_layer.grad_output_buffer = []
    return model, tiny_batch(cfg)


@pytest.mark.parametrize("make", [
    FusedLogprobProcessor, LogprobEntropyProcessor, lambda: LinearCEProcessor(reduction="sum"),
], ids=["logprob", "logprob-entropy", "linear-ce"])
def test_deferred_embedding_wgrad_is_refused_before_anything_runs(make):
    """The flush would pop from a buffer a processor never fills (Megatron's IndexError at the
    end of the step): refused at the call, naming the option, nothing stored or written."""
    model, batch = _deferring_model()
    weight = model.output_layer.weight
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        model(**batch, output_processor=make())
    assert model.output_layer.embedding_activation_buffer == [] and weight.grad is None
    with torch.no_grad():  # no gradient, nothing deferred: allowed
        model(**batch, output_processor=make())
    out = model(**batch, output_processor=DefaultProcessor())  # calls the output layer itself
    assert out.shape == batch["labels"].shape and len(model.output_layer.embedding_activation_buffer) == 1


# --------------------------------------------------------------------------- loss_mask


def _layer_and_hidden(b=2, s=16, h=8, v=30):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(s, b, h, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    return layer, hidden, labels


@pytest.mark.parametrize("shape", [(16,), (1, 16), (32,), (16, 2), (2, 15)])
@pytest.mark.parametrize("make", [
    lambda: LinearCEProcessor(reduction="mean"),
    lambda: PolicyLossProcessor(),
], ids=["linear-ce-mean", "policy"])
def test_loss_mask_of_another_shape_is_refused(make, shape):
    """``loss_mask`` is ``[b, s]`` like the labels; a ``[s]`` or ``[1, s]`` one used to be broadcast
    silently (another loss), ``[b*s]`` / ``[s, b]`` crashed deep inside without naming it."""
    layer, hidden, labels = _layer_and_hidden()
    ctx = {"old_logprobs": torch.zeros(2, 16), "advantages": torch.ones(2, 16)}
    kw = hook_keywords(hidden, layer, labels=labels, loss_mask=torch.ones(shape), context=ctx)
    with pytest.raises(ValueError, match=r"loss_mask: expected shape \(2, 16\)"):
        make()(**kw)


# --------------------------------------------------------------------------- upstream_grad under the schedules


def _call(fn, **kwargs):
    """``fn`` with the keywords its release takes (the schedules' signatures moved)."""
    import inspect

    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _seen_by_the_loss(returns: int, num_microbatches: int, per_token: bool, cp: int,
                      loss_scale: Optional[float] = None):
    """Megatron's own forward and backward step (``schedules.forward_step`` /
    ``backward_step``, what every schedule runs per micro-batch on the last stage) over a model
    whose output is a scalar loss formed inside it; the gradient that loss received, and what
    megatron_upstream_grad declares."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    from mcore_hooks import megatron_upstream_grad

    cfg = TinyModelConfig(tied=False)
    model = build_tiny_model(cfg)
    model.config.calculate_per_token_loss = per_token
    model.config.context_parallel_size = cp  # what the schedules' cp_group_size is, with CP
    if loss_scale is not None:  # the optimizer's scale_loss: a device scalar times the loss
        model.config.grad_scale_func = lambda loss: torch.tensor(loss_scale) * loss
    batch = tiny_batch(cfg)
    seen = []

    def forward_step(data_iterator, model):
        out = model(**batch).sum()  # a loss formed inside the model
        out.register_hook(lambda g: seen.append(float(g)))

        def loss_func(loss):
            loss = loss * 1.0  # the schedule scales what it gets in place
            return (loss, {}) if returns == 2 else (loss, torch.tensor(7), {})

        return out, loss_func

    for _ in range(num_microbatches):
        result = _call(
            schedules.forward_step, forward_step_func=forward_step, data_iterator=None, model=model,
            num_microbatches=num_microbatches, input_tensor=None, forward_data_store=[],
            config=model.config, cp_group_size=cp, is_last_stage=True,
        )
        output = result[0] if isinstance(result, tuple) else result
        _call(schedules.backward_step, input_tensor=[None], output_tensor=output,
              output_tensor_grad=[None], model_type=ModelType.encoder_or_decoder, config=model.config)
    return seen, megatron_upstream_grad(model.config, num_microbatches, loss_func_returns=returns)


@pytest.mark.parametrize("cp, microbatches, loss_scale", [(1, 3, None), (2, 3, None), (3, 7, None),
                                                        (6, 13, 3.0), (1, 5, 0.3)])
@pytest.mark.parametrize("returns, per_token", [(2, False), (2, True), (3, True)])
def test_megatron_upstream_grad_is_what_the_schedule_gives(returns, per_token, cp, microbatches, loss_scale):
    """Bit for bit: the kernels' backward compares the gradient it receives with ==, so the
    declaration must be the schedule's float32 arithmetic in its order (cp=3, M=7 and a loss
    scale of 3 or 0.3 round differently from a float64 quotient)."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    if cp > 1 and "cp_group_size" not in inspect.signature(schedules.forward_step).parameters:
        pytest.skip("this release's forward_step reads the CP size from parallel_state (CP=1 here)")
    seen, declared = _seen_by_the_loss(returns, microbatches, per_token, cp, loss_scale)
    assert seen == [declared] * microbatches
    assert torch.tensor(seen[0], dtype=torch.float32) == declared  # as the kernels compare


@pytest.mark.parametrize("processor", ["policy", "ce-sum", "policy-per-token-loss"])
def test_a_processors_loss_returned_as_is_through_megatrons_step(processor):
    """A loss function that returns the processor's loss itself, as users write it: Megatron's
    ``forward_step`` divides it in place (``output_tensor /= num_microbatches``) before
    ``backward_step``. The fused losses kept that tensor for their backward and raised there
    ("modified by an inplace operation"; a 4-GPU step at hidden 3584); the gradients now equal
    those of a loss function that returns a copy."""
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules

    from mcore_hooks.kernels import PolicyLoss

    cfg = TinyModelConfig(tied=False)
    batch = tiny_batch(cfg)
    b, s = batch["labels"].shape
    context = {"old_logprobs": -torch.ones(b, s), "advantages": torch.linspace(-1, 1, b * s).view(b, s)}
    grads = []
    for copied in (True, False):
        model = enable_output_processor(build_tiny_model(cfg))
        if processor == "ce-sum":
            proc, ctx = LinearCEProcessor(reduction="sum"), None
        else:
            loss = PolicyLoss() if processor == "policy" else (lambda lp, ent, advantages: -advantages * lp)
            proc = PolicyLossProcessor(loss=loss, aggregation="token-sum", as_tuple=True)
            ctx = context if processor == "policy" else {"advantages": context["advantages"]}

        def forward_step(data_iterator, model):
            out = model(**batch, output_processor=proc, output_processor_context=ctx)
            loss = out if processor == "ce-sum" else out[0]

            def loss_func(loss):
                return (loss * 1.0 if copied else loss), {}

            return loss, loss_func

        for _ in range(2):
            result = _call(schedules.forward_step, forward_step_func=forward_step, data_iterator=None,
                           model=model, num_microbatches=2, input_tensor=None, forward_data_store=[],
                           config=model.config, cp_group_size=1, is_last_stage=True)
            output = result[0] if isinstance(result, tuple) else result
            _call(schedules.backward_step, input_tensor=[None], output_tensor=output,
                  output_tensor_grad=[None], model_type=ModelType.encoder_or_decoder, config=model.config)
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_megatron_upstream_grad_refuses_what_cannot_be_declared():
    from mcore_hooks import megatron_upstream_grad

    config = copy.copy(build_tiny_model(TinyModelConfig(tied=False)).config)
    config.calculate_per_token_loss = False
    with pytest.raises(ValueError, match="num_tokens, a data-dependent gradient"):
        megatron_upstream_grad(config, 2, loss_func_returns=3)
    config.fp16 = True
    with pytest.raises(ValueError, match="fp16's dynamic loss scale"):
        megatron_upstream_grad(config, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        megatron_upstream_grad(config, 0)


# --------------------------------------------------------------------------- upstream's keywords


def test_scale_logits_is_bound_to_the_model_on_every_release():
    """Upstream passes the model's bound ``_scale_logits`` (``scale_logits.__self__ is model``,
    as its own hook test checks); releases without MuP scaling (0.13-0.16) now pass an identity
    bound to the model, not a module-level function."""
    cfg = TinyModelConfig()
    model = enable_output_processor(build_tiny_model(cfg))
    seen = {}

    def processor(**kw):
        seen.update(kw)
        return kw["hidden_states"].sum()

    model(**tiny_batch(cfg), output_processor=processor)
    assert seen["scale_logits"].__self__ is model
    x = torch.randn(3, 2)
    assert torch.equal(seen["scale_logits"](x), x)
    from mcore_hooks.postprocess import PostprocessContext

    assert PostprocessContext.from_kwargs(seen).logit_scale() == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_backend_for_a_cuda_device_answers_without_one():
    from mcore_hooks.kernels import backend_for

    assert backend_for(torch.bfloat16, "cuda").startswith("none: no CUDA device here")
    assert backend_for(torch.bfloat16, "cpu") == "torch"


def test_a_misspelled_context_key_names_output_processor_context():
    layer, hidden, labels = _layer_and_hidden()
    ctx = {"old_logprob": torch.zeros(2, 16), "advantages": torch.ones(2, 16)}
    with pytest.raises(ValueError, match=r"output_processor_context: missing 'old_logprobs'; unexpected 'old_logprob'"):
        PolicyLossProcessor()(**hook_keywords(hidden, layer, labels=labels, context=ctx))


def test_results_at_batch_one_are_not_views_of_what_the_backward_saved():
    """At b = 1 the [s, b] -> [b, s] transpose is contiguous, so the result was a view of the
    entropy the kernel saved for its backward: an in-place edit (a mask applied with mul_)
    raised in the backward. Results are their own tensors."""
    layer, hidden, labels = _layer_and_hidden(b=1)
    h = hidden.clone().requires_grad_()
    out = LogprobEntropyProcessor()(**hook_keywords(h, layer, labels=labels))
    ref = out["entropy"].detach().clone()
    out["entropy"].mul_(0.5)
    (out["logprobs"].sum() + out["entropy"].sum()).backward()
    h2 = hidden.clone().requires_grad_()
    again = LogprobEntropyProcessor()(**hook_keywords(h2, layer, labels=labels))
    (again["logprobs"].sum() + 0.5 * again["entropy"].sum()).backward()
    torch.testing.assert_close(out["entropy"], 0.5 * ref)
    torch.testing.assert_close(h.grad, h2.grad)


def test_an_mxfp8_lm_head_is_named():
    """Megatron Core 0.19's MXFP8 LM head computes stock's logits through an MXFP8 GEMM, which a
    processor reading the weight bypasses: it says so."""
    import types

    layer, hidden, labels = _layer_and_hidden()
    kw = hook_keywords(hidden, layer, labels=labels)
    kw["config"] = types.SimpleNamespace(context_parallel_size=1, fp8_output_proj=True, fp8="e4m3",
                                         fp8_recipe="mxfp8")
    with pytest.warns(UserWarning, match="fp8_output_proj: the model's output layer runs an MXFP8 GEMM"):
        FusedLogprobProcessor()(**kw)
    kw["config"].fp8_output_proj = False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedLogprobProcessor()(**kw)


# --------------------------------------------------------------------------- the output layer's hooks


@pytest.mark.parametrize("how", ["ignores-layer", "reads-weight", "calls-layer"])
def test_the_output_layers_hooks_run_as_upstreams(how):
    """Upstream calls the processor instead of the output layer: none of the layer's hooks run
    unless the processor calls it (1 pre, 1 post) or reads its inputs (``ctx.output_layer_inputs()``:
    the pre-hooks once, as the distributed optimizer's all-gather wait needs). On 0.18+ this
    measures upstream itself; on the backport, which called the processor from a pre-hook, the
    counts were 1/0 and 2/1 (a Megatron-FSDP unshard without its reshard)."""
    from mcore_hooks import PostprocessProcessor

    class Processor(PostprocessProcessor):
        def process(self, ctx):
            if how == "calls-layer":
                return ctx.logits().sum()
            if how == "reads-weight":
                hidden, weight = ctx.output_layer_inputs()
                return (hidden.float() @ weight.float().t()).sum()
            return ctx.hidden_states.sum()

    cfg = TinyModelConfig(tied=False)
    model = enable_output_processor(build_tiny_model(cfg))
    counts = {"pre": 0, "post": 0}
    handles = [
        model.output_layer.register_forward_pre_hook(lambda *_: counts.__setitem__("pre", counts["pre"] + 1)),
        model.output_layer.register_forward_hook(lambda *_: counts.__setitem__("post", counts["post"] + 1)),
    ]
    try:
        model(**tiny_batch(cfg), output_processor=Processor())
    finally:
        for h in handles:
            h.remove()
    expected = {"ignores-layer": (0, 0), "reads-weight": (1, 0), "calls-layer": (1, 1)}[how]
    assert (counts["pre"], counts["post"]) == expected
    assert type(model.output_layer).__name__ == "ColumnParallelLinear"  # its class is back
