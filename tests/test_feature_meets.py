"""Where two options meet: each combination exact, or refused before any state changes."""

from __future__ import annotations

import copy

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
