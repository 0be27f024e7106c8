"""NeMo RL's linear-CE-fusion log-probs, per model instance, with context parallelism, packed
sequences and the temperature applied to the logits.

NeMo RL (Megatron policy) fuses the log-prob computation with
``patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=...)``, which replaces
``GPTModel.forward`` for the whole class; the model is then called with ``labels=input_ids`` (the
unshifted ids) and ``return_logprobs_for_linear_ce_fusion=True`` and returns float32 ``[B, S-1]``
log-probs of ``input_ids[:, 1:]``. That path asserts context parallelism is off, skips the MTP
step, rolls labels across packed-sequence boundaries, and the training loop then divides those
log-probs by the sampling temperature (``apply_temperature_scaling``), where the logits should
have been divided. :class:`NemoRLLogprobProcessor` is the replacement::

    from mcore_hooks import enable_output_processor
    from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor

    model = enable_output_processor(model)   # this instance only: no class patch
    logprobs = model(input_ids, position_ids, attention_mask, labels=input_ids,
                     output_processor=NemoRLLogprobProcessor(temperature=0.7))
    # float32 [B, S-1]: log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) at temperature 0.7;
    # do not divide them by the temperature again

The same inputs (``labels=input_ids``) and output (``[B, S-1]``) as the patch, plus:

* the temperature divides the logits, once (a float, or one per sample);
* packed (THD) batches: ``input_ids`` ``[1, T]`` with ``packed_seq_params``; each sequence's
  labels are rolled within it, so no label crosses a sequence boundary: the output is ``[1, T-1]``
  with 0 at each sequence's last position (NeMo RL's loss wrapper reads each sequence's first
  ``L - 1`` entries);
* context parallelism with Megatron's load-balanced layout (each CP rank holds chunks ``r`` and
  ``2 cp - 1 - r`` of ``2 cp`` along the sequence, as NeMo RL shards ``input_ids``): the next
  tokens come from the whole sequence, and the output is the whole ``[B, S-1]`` on every CP rank,
  gathered as NeMo RL's ``AllGatherCPTensor`` gathers it (its backward all-reduces the gradient
  over the CP group and keeps this rank's chunks); with packed batches, each packed sequence is
  laid out that way (NeMo RL requires packing whenever CP > 1);
* multi-token prediction as NeMo RL's own non-fused path runs it: the model called with
  ``labels=None`` and ``loss_mask=token_mask * sample_mask`` (unshifted), Megatron Core 0.19+
  derives each depth's targets from ``input_ids`` (and rolls the mask, and rescales), and the
  depths' loss takes the fused kernel. With ``labels=input_ids`` and MTP on it is refused (a
  ``ValueError`` from the first depth, before any loss is formed): Megatron's MTP takes
  ``labels`` as already shifted and rolls them once more per depth, so depth ``k`` would learn
  ``input_ids[t + k]``, the token it is fed. (NeMo RL's own fused path skips the MTP step.)

NeMo RL itself is not needed to import this module.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .. import compat
from ..mtp import MTPDepth, MTPLoss, labels_given
from ..postprocess import PostprocessContext
from ..kernels.common.comm import all_reduce
from ..processors.fused import _FusedProcessor
from ..processors.labels import cp_global_positions, labels_from_input_ids

__all__ = ["NemoRLLogprobProcessor"]


class NemoRLLogprobProcessor(_FusedProcessor):
    """Float32 ``[B, S-1]`` next-token log-probs of ``labels`` (NeMo RL passes ``input_ids``).

    Args:
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (NeMo RL's
            ``fused_linear_logprobs_chunk_size``; None: about 2**26 logits a chunk); the Triton
            backend sizes its own tiles.
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see
            :func:`~mcore_hooks.kernels.backend_for`).
    """

    def __init__(
        self,
        *,
        temperature: Union[float, torch.Tensor] = 1.0,
        chunk_size: Optional[int] = None,
        ignore_index: int = -100,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)

    def mtp_loss(self, depth: MTPDepth) -> MTPLoss:
        """The fused MTP loss where the model got no ``labels`` (Megatron 0.19+ derives each
        depth's targets from ``input_ids``: NeMo RL's own non-fused call); refused with NeMo RL's
        unshifted ``labels=input_ids`` (see the module docstring)."""
        if labels_given() is not False:
            why = ("NemoRLLogprobProcessor with multi-token prediction: called with labels (NeMo "
                   "RL's labels=input_ids are unshifted), but Megatron's MTP takes labels as "
                   "next-token labels and rolls them once more per depth, so each depth would learn "
                   "the token it is fed, over one token too many per sequence. ")
            if compat.mtp_derives_labels():
                raise ValueError(why + "Call the model with labels=None and loss_mask=token_mask * "
                                 "sample_mask, as NeMo RL's non-fused path does (Megatron Core "
                                 "derives the depths' targets from input_ids), or turn MTP off")
            raise ValueError(why + "This Megatron Core's MTP needs labels (deriving them from "
                             "input_ids arrived in 0.19), so there is no way to run NeMo RL's "
                             "unshifted call with MTP on it: turn MTP off, or use Megatron Core 0.19+")
        return super().mtp_loss(depth)

    def labels(self, ctx: PostprocessContext) -> torch.Tensor:
        """The next token of each position of ``labels`` (``input_ids``), per sequence when
        packed, across the whole sequence under context parallelism; ignored at the end."""
        ids = ctx.labels if ctx.labels is not None else ctx.input_ids
        if ids is None:
            raise ValueError("labels: NeMo RL passes labels=input_ids; neither was given")
        if ctx.cp_size == 1:
            return labels_from_input_ids(ids, self.ignore_index, ctx.packed_seq_params)
        layout = _CPLayout(ctx, ids.shape[-1], ids.device)
        full = labels_from_input_ids(layout.gather(ids), self.ignore_index, ctx.packed_seq_params)
        return layout.local(full)

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        r, bs, _ = self.compute(ctx)
        logprobs = self.to_bs(r.logprob, bs)  # [B, S_local]
        if ctx.cp_size > 1:
            logprobs = _GatherCP.apply(logprobs, _CPLayout(ctx, bs[1], logprobs.device),
                                       self.batch_invariant)
        return logprobs[:, :-1]


class _CPLayout:
    """This CP rank's tokens within the whole sequence (Megatron's load-balanced layout, per
    packed sequence for THD input: :func:`~mcore_hooks.processors.labels.cp_global_positions`),
    to gather ``[B, S_local]`` shards into the whole ``[B, S]`` and take this rank's part back."""

    def __init__(self, ctx: PostprocessContext, local_len: int, device: torch.device) -> None:
        self.group = ctx.cp_group
        self.rank, self.size = compat.group_rank_size(ctx.cp_group)
        self.positions = [
            cp_global_positions(local_len, r, self.size, ctx.packed_seq_params, device)
            for r in range(self.size)
        ]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[B, S_local]`` shards -> the whole ``[B, S]`` on every rank."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        full = local.new_empty(local.shape[:-1] + (local.shape[-1] * self.size,))
        for pos, part in zip(self.positions, parts):
            full[..., pos] = part
        return full

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """The whole ``[B, S]`` -> this rank's ``[B, S_local]``."""
        return full[..., self.positions[self.rank]]


class _GatherCP(torch.autograd.Function):
    """:meth:`_CPLayout.gather` with NeMo RL's gradient: all-reduced over the CP group (every
    rank's loss reads the whole sequence), then this rank's part."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: _CPLayout, ordered: bool) -> torch.Tensor:
        ctx.layout, ctx.ordered = layout, ordered
        return layout.gather(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # batch invariance: past two ranks, added in rank order (a collective's order
        # depends on the message size)
        grad = all_reduce(grad.contiguous().clone(), dist.ReduceOp.SUM, ctx.layout.group, ctx.ordered)
        return ctx.layout.local(grad), None, None
