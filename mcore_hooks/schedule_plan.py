"""The ``output_processor`` through ``build_schedule_plan`` and the combined-1F1B post-process node.

Megatron Core's combined-1F1B schedule (``overlap_moe_expert_parallel_comm``, 0.14+) does not
call ``model.forward``: ``GPTModel.build_schedule_plan(...)`` returns a plan of schedule nodes, and
the plan's post-process node runs the model's post-process (final norm, MTP, output layer, loss).
From 0.18 that method takes the same ``output_processor=`` / ``output_processor_context=``
keywords as ``forward`` and the node calls the processor in place of the output layer.

On 0.14-0.17, :func:`~mcore_hooks.enable_output_processor` gives the instance the same keywords
(:class:`~mcore_hooks.hooked.BackportHookMixin`), and :func:`attach_processor` threads the
processor into the one plan it returns. Upstream facts the seam respects:

* the node captures ``weak_method(self.forward_impl)`` when it is built, so rebinding the node's
  ``forward_impl`` (or its class) afterwards does nothing; the callable the node actually calls is
  its ``forward_func`` attribute, an ordinary attribute of that node object: it is replaced
  there, on that node of that plan, and nothing else;
* the node class moved between releases (``gpt/fine_grained_callables.py`` to
  ``common/utils.py``), and 0.16 added ``padding_mask``: the seam names neither;
* the processor gets exactly what ``forward``'s processor gets: the hidden states and weight the
  output layer is called with (after the stock final norm; sequence-parallel shards), and the
  labels, loss mask, ids, masks, decoder input and packed-sequence parameters the plan holds
  for that micro-batch. Its result goes through ``float16_to_fp32`` as upstream's node does.

Under the plan the scheduler calls ``make_viewless`` on the result, casts fp16/bf16 to fp32
recursing into tuples only, and calls ``loss_func(*outputs)``: a result must be a tensor or a
tuple of tensors (or None entries). :func:`check_plan_result` says so with a TypeError instead of
a crash deep in the scheduler. Its backward gives the outputs the loss did not use no gradient,
and upstream's node then fails; :func:`post_process_backward` replaces it on that one node.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import compat
from .mtp import MTPCalls, mtp_loss_hook, mtp_loss_of, native_mtp_loss
from .postprocess import check_output_processor

__all__ = ["attach_processor", "attach_native", "check_plan_result", "post_process_backward"]


def check_plan_result(result: Any, output_processor: Any) -> None:
    """TypeError naming ``output_processor`` unless ``result`` is a tensor or a tuple of tensors
    (``None`` entries allowed, as upstream passes them to the loss function)."""
    if isinstance(result, torch.Tensor):
        return
    if isinstance(result, tuple) and any(isinstance(t, torch.Tensor) for t in result) and all(
        t is None or isinstance(t, torch.Tensor) for t in result
    ):
        return
    if isinstance(result, dict):
        got = f"a dict with keys {sorted(map(str, result))}"
    elif result is None:
        got = "None"
    elif isinstance(result, tuple):
        got = f"a tuple of {', '.join(type(t).__name__ for t in result) or 'nothing'}"
    else:
        got = f"a {type(result).__module__}.{type(result).__qualname__}"
    raise TypeError(
        f"output_processor {output_processor!r} returned {got} under the combined-1F1B schedule "
        "plan, which takes a tensor or a tuple of tensors (the scheduler detaches them and calls "
        "loss_func(*outputs)); return a tuple instead, e.g. LogprobEntropyProcessor(as_tuple=True)"
    )


def post_process_backward(outputs: tuple, output_grad: tuple) -> tuple:
    """The post-process node's backward, over the outputs the loss used.

    The plan's loss node hands back each output's ``.grad``: None for an output the loss did not
    use differentiably (an entropy only logged), and upstream's node then passes every output to
    one ``backward``, which rejects a None gradient, a detached output (a processor's metrics) and
    a None output. Leaving those out is the same as a zero gradient for them."""
    pairs = [(t, g) for t, g in zip(outputs, output_grad)
             if isinstance(t, torch.Tensor) and t.requires_grad and g is not None]
    if not pairs:  # the next node back would fail far from here, on a None gradient
        raise RuntimeError(
            "combined-1F1B schedule plan: loss_func used none of output_processor's outputs "
            "differentiably (every gradient it handed back is None, or no output requires grad), "
            "so nothing reaches the model"
        )
    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return output_grad


def attach_processor(
    model: Any, plan: Any, output_processor: Callable[..., Any], context: Any,
    call_at_output_layer: Callable[..., tuple[bool, Any]],
) -> Any:
    """Make ``plan`` (just built by ``model.build_schedule_plan``) call ``output_processor`` in its
    post-process node instead of the output layer, with the keywords ``forward`` would pass.
    ``call_at_output_layer`` is the backport's interception of the stock output-layer call
    (:func:`mcore_hooks.hooked.call_processor_at_output_layer`), passed in by the class that
    owns it. Returns ``plan``. Backport only: on 0.18+ ``build_schedule_plan`` does this itself."""
    check_output_processor(output_processor)
    state = plan.state
    # As upstream's plan holds them (0.18+), for code that reads them there.
    state.output_processor, state.output_processor_context = output_processor, context
    node = plan.post_process
    if node is None:  # not the last pipeline stage: the processor never runs
        return plan
    stock_forward_func = node.forward_func  # the node's weak_method(forward_impl)

    def keywords() -> dict:
        return dict(
            labels=state.labels,
            loss_mask=state.loss_mask,
            input_ids=state.input_ids,
            position_ids=state.position_ids,
            attention_mask=state.attention_mask,
            decoder_input=state.decoder_input,
            inference_context=None,  # the plan keeps none (nor does 0.18+'s node pass one)
            packed_seq_params=state.packed_seq_params,
            runtime_gather_output=state.runtime_gather_output,
            context=context,
            compute_language_model_loss=model.compute_language_model_loss,
            scale_logits=compat.scale_logits_of(model),
            config=model.config,
        )

    # Captures the stock callable, the plan's state and the model (which the node holds too),
    # never the node itself: weak_method is there to keep the node free of reference cycles.
    def forward_func(hidden_states: torch.Tensor) -> Any:
        with MTPCalls(model) as calls, mtp_loss_hook(model, mtp_loss_of(output_processor), calls,
                                                     state.labels):
            called, result = call_at_output_layer(
                model, lambda: stock_forward_func(hidden_states), output_processor, keywords, calls
            )
        if not called:
            raise RuntimeError(
                "the schedule plan's post-process node returned without reaching the output "
                "layer, so output_processor was not called"
            )
        check_plan_result(result, output_processor)
        from megatron.core.transformer.module import float16_to_fp32

        return float16_to_fp32(result)

    node.forward_func = forward_func
    node.backward_func = post_process_backward
    return plan


def attach_native(model: Any, plan: Any, output_processor: Any) -> Any:
    """On a native plan (0.18+), with a processor: its post-process node backpropagates only the
    outputs the loss used (:func:`post_process_backward`), and runs with the processor's MTP loss
    where the release needs the stand-ins for it (:mod:`mcore_hooks.mtp`); the processor itself
    is upstream's to call. Returns ``plan``."""
    node = plan.post_process
    if node is None or output_processor is None:
        return plan
    node.backward_func = post_process_backward
    mtp_loss = native_mtp_loss(model, output_processor)
    if mtp_loss is None:
        return plan
    stock_forward_func, state = node.forward_func, plan.state

    def forward_func(hidden_states: torch.Tensor) -> Any:  # captures no node (see above)
        with MTPCalls(model) as calls, mtp_loss_hook(model, mtp_loss, calls, state.labels):
            return stock_forward_func(hidden_states)

    node.forward_func = forward_func
    return plan
