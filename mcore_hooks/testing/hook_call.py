"""Calling a processor directly, as a hook would, without a model.

Context parallelism needs Transformer Engine's attention, which the CPU test models lack; a
processor needs only what the hook passes it, so CP tests call it with a bare output layer and
:func:`hook_keywords`.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

from ..compat import group_rank_size

__all__ = ["hook_keywords"]


class _Model:
    """What a processor learns about the model from the hook: its bound
    ``compute_language_model_loss`` (whose ``__self__`` carries the model's ``cp_group``)."""

    def __init__(self, cp_group: Any) -> None:
        self.cp_group = cp_group

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("hook_keywords' stand-in model computes no stock loss")


def hook_keywords(
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    *,
    labels: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
    input_ids: Optional[torch.Tensor] = None,
    cp_group: Any = None,
    context: Any = None,
    packed_seq_params: Any = None,
) -> dict:
    """The 16 keywords an ``output_processor`` gets, for a model whose output layer is
    ``output_layer`` (no MuP scaling, untied) and whose context-parallel group is ``cp_group``
    (None: no CP).

    Args:
        hidden_states: ``[s, b, h]`` (this rank's tokens under CP).
        output_layer: a module with the output ``weight`` ``[V, h]`` (``torch.nn.Linear``).
        labels: ``[b, s]`` labels, or None.
        loss_mask: ``[b, s]``, or None.
        input_ids: ``[b, s]``, or None.
        cp_group: the context-parallel group, or None.
        context: the ``output_processor_context``.
        packed_seq_params: Megatron's ``PackedSeqParams`` of a packed THD batch (global
            ``cu_seqlens`` under CP, as Megatron keeps them), or None.

    Returns:
        The keywords, in upstream's order.
    """
    model = _Model(cp_group)
    return dict(
        hidden_states=hidden_states, output_layer=output_layer, output_weight=None, labels=labels,
        loss_mask=loss_mask, input_ids=input_ids, position_ids=None, attention_mask=None,
        decoder_input=None, inference_context=None, packed_seq_params=packed_seq_params,
        runtime_gather_output=None, context=context,
        compute_language_model_loss=model.compute_language_model_loss,
        scale_logits=lambda logits: logits,
        config=types.SimpleNamespace(context_parallel_size=group_rank_size(cp_group)[1]),
    )
