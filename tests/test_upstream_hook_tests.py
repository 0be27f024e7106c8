"""Megatron-LM's own tests of the hook, run against ``enable_output_processor`` on every release.

"Identical to upstream's hook" is the promise, and upstream's tests are its definition:
``tests/unit_tests/models/test_gpt_model.py::TestGPTModel::test_output_processor_forward`` (the
release branch ``core_r0.19.0``, a tensor result; ``main``, PR #5739, a dict result) and
``::test_build_schedule_plan_threads_output_processor``. Their bodies are kept as they are;
adapted only as far as a CPU needs: the model is the suite's tiny GPTModel (local spec, CPU core
attention) instead of a Transformer Engine one on CUDA, with the batch's own causal mask, and the
plan's CUDA streams are stood in for (:func:`mcore_hooks.testing.schedule_plan_on_cpu`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_hooks import enable_output_processor
from mcore_hooks.testing import TinyModelConfig, build_tiny_model, schedule_plan_on_cpu, stock_model_class, tiny_batch

pytestmark = pytest.mark.usefixtures("mp1")


def _model_and_inputs():
    cfg = TinyModelConfig(tied=False)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg, batch_size=2)
    return model, batch["input_ids"], batch["position_ids"], batch["attention_mask"]


@pytest.mark.parametrize("form", ["core_r0.19.0", "main"], ids=["tensor-result", "dict-result"])
def test_output_processor_forward(form):
    model, input_ids, position_ids, attention_mask = _model_and_inputs()
    config = model.config
    labels = (input_ids + 1) % model.vocab_size
    model.eval()

    context = {"selected_token_positions": torch.tensor([0, 2])}
    created = {}
    seen = {}

    def output_processor(**kwargs):
        seen.update(kwargs)
        logits, _ = kwargs["output_layer"](
            kwargs["hidden_states"],
            weight=kwargs["output_weight"],
            runtime_gather_output=kwargs["runtime_gather_output"],
        )
        logits = kwargs["scale_logits"](logits).transpose(0, 1).contiguous().float()
        token_logprobs = F.log_softmax(logits, dim=-1).gather(dim=-1, index=kwargs["labels"].unsqueeze(-1))
        token_logprobs = token_logprobs.squeeze(-1)
        payload = token_logprobs.index_select(1, kwargs["context"]["selected_token_positions"])
        if form == "core_r0.19.0":
            return payload
        result = {"payload": payload, "tag": "structured"}
        created["result"] = result
        return result

    with torch.no_grad():
        logits = model.forward(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).float()
        expected = F.log_softmax(logits, dim=-1).gather(dim=-1, index=labels.unsqueeze(-1))
        expected = expected.squeeze(-1).index_select(1, context["selected_token_positions"])

        output = model.forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            labels=labels,
            output_processor=output_processor,
            output_processor_context=context,
        )

    if form == "core_r0.19.0":
        assert torch.allclose(output, expected)
    else:
        assert output is created["result"]
        assert isinstance(output, dict)
        assert torch.allclose(output["payload"], expected)
        assert output["tag"] == "structured"
    assert seen["context"] is context
    assert seen["output_layer"] is model.output_layer
    assert seen["output_weight"] is None
    assert seen["output_layer"].weight is not None
    assert seen["labels"] is labels
    assert seen["runtime_gather_output"] is None
    assert seen["config"] is config
    assert seen["compute_language_model_loss"].__self__ is model
    assert seen["scale_logits"].__self__ is model


@pytest.mark.skipif(not hasattr(stock_model_class("gpt"), "build_schedule_plan"),
                    reason="no combined-1F1B schedule plan before Megatron Core 0.14")
def test_build_schedule_plan_threads_output_processor():
    model, input_ids, position_ids, attention_mask = _model_and_inputs()
    model.decoder.final_layernorm = None  # upstream's plan skips it for a dense last layer (0.16+)
    sequence_length, micro_batch_size = input_ids.shape[1], input_ids.shape[0]
    labels = input_ids.clone()

    context = {"loss_mask": torch.ones_like(labels)}

    seen = {}

    def output_processor(**kwargs):
        seen.update(kwargs)
        return kwargs["hidden_states"].sum()

    with schedule_plan_on_cpu():
        schedule_plan = model.build_schedule_plan(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            labels=labels,
            output_processor=output_processor,
            output_processor_context=context,
        )

        assert schedule_plan.state.output_processor is output_processor
        assert schedule_plan.state.output_processor_context is context

        schedule_plan.state.decoder_input = None
        schedule_plan.state.rotary_pos_emb = None
        schedule_plan.state.rotary_pos_cos = None
        schedule_plan.state.rotary_pos_sin = None
        schedule_plan.state.sequence_len_offset = None

        hidden_states = torch.randn(sequence_length, micro_batch_size, model.config.hidden_size, requires_grad=True)
        output = schedule_plan.post_process.forward(hidden_states)

    assert output.item() == pytest.approx(hidden_states.sum().item())
    assert seen["context"] is context
    assert seen["labels"] is labels
    assert seen["output_layer"] is model.output_layer
