"""verl's fused log-prob / entropy processor, for every supported Megatron Core.

verl (Megatron backend) gets log-probs and entropies without logits in one of three ways: on
Megatron Core >= 0.18 it passes ``output_processor=fused_output_processor`` with
``output_processor_context=FusedOutputProcessorContext(temperature=...)``; below 0.18 it replaces
the model instance's ``forward`` with a copy that skips ``_postprocess``; with multi-token
prediction on, or per-sample temperatures, it has no fused path (every MTP depth builds
``[tokens, vocab]`` logits). :class:`VerlFusedProcessor` keeps verl's contract and serves all of
them with one call, on Megatron Core 0.13-0.20 (``upstream/verl/`` is the series that has verl use
it where its own processor cannot)::

    from mcore_hooks import enable_output_processor
    from mcore_hooks.integrations.verl import FusedOutputProcessorContext, VerlFusedProcessor

    model = enable_output_processor(model)   # the hook below 0.18; with MTP on, the depths' loss
    output = model(input_ids=input_ids_rmpad, position_ids=None, attention_mask=None,
                   packed_seq_params=packed_seq_params, labels=labels_rmpad,
                   output_processor=VerlFusedProcessor(),
                   output_processor_context=FusedOutputProcessorContext(temperature=0.7))
    output.log_probs, output.entropy   # float32, one per token of the packed (THD) batch

``enable_output_processor`` switches the instance's class below 0.18 (to one adding the hook) and,
on 0.18+, only with MTP on or the combined-1F1B schedule configured (to one that passes the
native calls through, adding for each call the MTP loss stand-ins, which send the depths' loss
through the processor's fused kernel: :mod:`mcore_hooks.mtp`, and on a schedule plan a
post-process backward over the outputs the loss used); otherwise Megatron's own hook serves.

The contract, as verl's ``fused_output_processor`` has it: the labels are the caller's (already
rolled, e.g. verl's ``preprocess_thd_engine(..., need_roll=True)``); ``log_probs`` and
``entropy`` are float32 and 1-D over the flattened ``[b, s]`` tokens (verl's batches are packed,
``b = 1``); ``hidden_states`` is the hook's, before any sequence-parallel gather. What differs:
the temperature may also be one per sample or one per token, which verl's kernel refuses; MuP
logit scaling is applied (verl ignores it); ``calculate_entropy=False`` gives ``entropy=None``;
``as_tuple=True`` returns ``(log_probs, entropy)`` for the combined-1F1B schedule plan; and with
MTP on every depth uses the fused kernel too (:mod:`mcore_hooks.mtp`). verl itself is not needed
to import this module.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ..kernels import linear_logprob_entropy
from ..kernels.common.options import is_finite
from ..mtp import MTPDepth, MTPLoss
from ..postprocess import PostprocessContext
from ..processors.fused import _check_flag, _FusedProcessor

__all__ = ["FusedOutputProcessorContext", "VerlFusedOutput", "VerlFusedProcessor"]


@dataclasses.dataclass
class FusedOutputProcessorContext:
    """verl's ``output_processor_context`` (any object with a ``temperature`` works).

    Args:
        temperature: divides the logits: a positive float; a 1-D float tensor of one per
            sample (one per packed sequence with packed THD input); or a ``[b, s]`` float tensor
            of one per token, laid out like the labels (verl packs and shards it as it does them,
            so any context-parallel layout and dynamic CP work).
    """

    temperature: Union[float, torch.Tensor] = 1.0


@dataclasses.dataclass
class VerlFusedOutput:
    """What verl's ``fused_output_processor`` returns (``CausalLMOutputForPPO``'s fields verl
    reads): float32 ``log_probs`` and ``entropy`` (None with ``calculate_entropy=False``), 1-D
    over the flattened ``[b, s]`` tokens, and the hook's ``hidden_states``."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    hidden_states: torch.Tensor
    loss: None = None
    logits: None = None


class VerlFusedProcessor(_FusedProcessor):
    """verl's fused log-prob / entropy processor (see the module docstring).

    Args:
        calculate_entropy: return the entropy too (computed in the same pass either way).
        as_tuple: return ``(log_probs, entropy)`` (``(log_probs,)`` without entropy) instead of
            :class:`VerlFusedOutput`: the form the combined-1F1B schedule plan takes.
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see
            :func:`~mcore_hooks.kernels.backend_for`).
        mtp_detach_weight: with MTP on, the depths' loss reads the output weight detached, as
            verl's own MTP loss does (the depths train the MTP block, not the shared head). Off:
            Megatron's semantics (the depths' gradient reaches the head too; on 0.19+ its
            ``mtp_detach_heads`` does the same).
    """

    def __init__(
        self,
        *,
        calculate_entropy: bool = True,
        as_tuple: bool = False,
        mtp_detach_weight: bool = False,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        _check_flag("calculate_entropy", calculate_entropy)
        _check_flag("as_tuple", as_tuple)
        _check_flag("mtp_detach_weight", mtp_detach_weight)
        self._set_options(1.0, ignore_index, chunk_size, backend, batch_invariant)  # the temperature comes per call
        self.mtp_detach_weight = mtp_detach_weight
        self.calculate_entropy = calculate_entropy
        self.as_tuple = as_tuple

    def mtp_loss(self, depth: MTPDepth) -> MTPLoss:
        """The fused MTP loss (see :class:`~mcore_hooks.processors.fused._FusedProcessor`), on
        the detached output weight with ``mtp_detach_weight``."""
        if self.mtp_detach_weight:
            depth = dataclasses.replace(depth, weight=depth.weight.detach())
        return super().mtp_loss(depth)

    def temperature_for(self, ctx: PostprocessContext) -> Union[float, torch.Tensor]:
        """``output_processor_context.temperature`` (1 without a context)."""
        if ctx.context is None:
            return 1.0
        temperature = getattr(ctx.context, "temperature", None)
        if temperature is None:
            raise TypeError(
                "output_processor_context: expected an object with a `temperature` "
                f"(FusedOutputProcessorContext), got {type(ctx.context).__name__}"
            )
        if isinstance(temperature, torch.Tensor):
            return temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            is_finite(temperature) and temperature > 0
        ):
            raise ValueError(
                "output_processor_context.temperature: expected a positive finite float, a 1-D "
                f"tensor of one per sample or a [b, s] tensor of one per token, got {temperature!r}"
            )
        return float(temperature)

    def process(self, ctx: PostprocessContext) -> Union[VerlFusedOutput, tuple]:
        k = self.kernel_inputs(ctx)
        r = linear_logprob_entropy(k.hidden, k.weight, k.labels, **k.kwargs)
        log_probs = self.to_bs(r.logprob, k.bs).view(-1)
        entropy = self.to_bs(r.entropy, k.bs).view(-1) if self.calculate_entropy else None
        if self.as_tuple:
            return (log_probs,) if entropy is None else (log_probs, entropy)
        return VerlFusedOutput(log_probs=log_probs, entropy=entropy, hidden_states=ctx.hidden_states)
