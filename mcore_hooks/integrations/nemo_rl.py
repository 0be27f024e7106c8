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
  over the CP group and keeps this rank's chunks). Not with packed batches;
* multi-token prediction: its loss with the fused kernel too (:mod:`mcore_hooks.mtp`).

NeMo RL itself is not needed to import this module.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .. import compat
from ..postprocess import PostprocessContext
from ..processors.fused import _FusedProcessor
from ..processors.labels import labels_from_input_ids

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
    ) -> None:
        self._set_options(temperature, ignore_index, chunk_size, backend)

    def labels(self, ctx: PostprocessContext) -> torch.Tensor:
        """The next token of each position of ``labels`` (``input_ids``), per sequence when
        packed, across the whole sequence under context parallelism; ignored at the end."""
        ids = ctx.labels if ctx.labels is not None else ctx.input_ids
        if ids is None:
            raise ValueError("labels: NeMo RL passes labels=input_ids; neither was given")
        if ctx.cp_size == 1:
            return labels_from_input_ids(ids, self.ignore_index, ctx.packed_seq_params)
        if ctx.packed_seq_params is not None:
            raise NotImplementedError(
                "NemoRLLogprobProcessor: packed sequences under context parallelism (each "
                "sequence's own CP layout) are not supported; NeMo RL's fused path has neither"
            )
        full = _cp_gather(ids, ctx.cp_group)
        return _cp_local(labels_from_input_ids(full, self.ignore_index), ctx.cp_group)

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        r, bs, _ = self.compute(ctx)
        logprobs = self.to_bs(r.logprob, bs)  # [B, S_local]
        if ctx.cp_size > 1:
            logprobs = _GatherCP.apply(logprobs, ctx.cp_group)
        return logprobs[:, :-1]


def _cp_order(cp: int) -> list[int]:
    """The sequence chunks the CP ranks hold, in rank order: ``0, 2cp-1, 1, 2cp-2, ...``."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def _cp_gather(local: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, S_local]`` CP shards (load-balanced layout) -> the whole ``[B, S]`` on every rank."""
    cp = compat.group_rank_size(group)[1]
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    chunks = [c for part in parts for c in part.chunk(2, dim=1)]
    ordered = sorted(zip(_cp_order(cp), chunks), key=lambda pair: pair[0])
    return torch.cat([c for _, c in ordered], dim=1)


def _cp_local(full: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole ``[B, S]`` -> this rank's ``[B, S_local]`` (chunks ``r`` and ``2cp - 1 - r``)."""
    rank, cp = compat.group_rank_size(group)
    chunks = full.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


class _GatherCP(torch.autograd.Function):
    """:func:`_cp_gather` with NeMo RL's gradient: all-reduced over the CP group (every rank's
    loss reads the whole sequence), then this rank's chunks."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _cp_gather(local, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _cp_local(grad, ctx.group), None
