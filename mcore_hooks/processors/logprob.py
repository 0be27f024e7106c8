"""Log-prob and entropy processors: the selected token's log-prob, the entropy, both in one pass."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..postprocess import PostprocessContext
from .fused import KeptSet, _check_flag, _check_kept_set, _FusedProcessor


class FusedLogprobProcessor(_FusedProcessor):
    """Log-probability of each label, float32 ``[b, s]`` (``-`` the stock per-token loss).

    Labels are the model's ``labels``, or next-token labels derived from ``input_ids`` (per
    sequence when packed). Under the combined-1F1B schedule plan the result is a tensor already.

    Args:
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only where
            fixed blocks or padding remain: the torch backend, a recomputed truncation, kept
            sets and wide id sets, and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
        kept_set: None (the full vocabulary), ``"replay"`` (renormalise over the rollout's
            sampling mask, :meth:`sampling_mask`) or a
            :class:`~mcore_hooks.kernels.Truncation` (top-k / top-p / min-p recomputed from these
            logits): the log-probs and entropies are then of the distribution the rollout
            sampled from.
    """

    def __init__(
        self,
        *,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        kept_set: KeptSet = None,
    ) -> None:
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        _check_kept_set(kept_set)
        self.kept_set = kept_set

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        r, bs, _ = self.compute(ctx)
        return self.to_bs(r.logprob, bs)


class EntropyProcessor(_FusedProcessor):
    """Entropy of each token's distribution, float32 ``[b, s]``; needs no labels.

    Positions whose label is ``ignore_index`` give 0 when labels are passed (or derived with
    ``mask_from_labels=True``); otherwise every position is computed.

    Args:
        mask_from_labels: without ``labels``, derive them from ``input_ids`` to zero the
            positions that have no next token (sequence ends, padding).
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only where
            fixed blocks or padding remain: the torch backend, a recomputed truncation, kept
            sets and wide id sets, and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
    """

    def __init__(
        self,
        *,
        mask_from_labels: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
    ) -> None:
        _check_flag("mask_from_labels", mask_from_labels)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        self.mask_from_labels = mask_from_labels

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        with_labels = ctx.labels is not None or self.mask_from_labels
        r, bs, _ = self.compute(ctx, with_labels=with_labels)
        return self.to_bs(r.entropy, bs)


class LogprobEntropyProcessor(_FusedProcessor):
    """Log-prob and entropy from one pass over the vocabulary (one matmul, not two).

    Returns ``{"logprobs": [b, s], "entropy": [b, s]}``, or with ``as_tuple=True`` the tuple
    ``(logprobs, entropy)``: the form the combined-1F1B schedule plan takes (a tensor or a tuple
    of tensors; the scheduler calls ``loss_func(*outputs)``).

    Args:
        as_tuple: return ``(logprobs, entropy)`` instead of the dict.
        temperature: divides the logits (never the log-probs): a positive float, or a 1-D float
            tensor of one per sample (``[b]``; one per packed sequence with packed THD input).
        ignore_index: the label of positions to skip (never a vocabulary id): they give 0 and no
            gradient.
        chunk_size: tokens per chunk of the torch backend's fp32 logits (None: about 2**26
            logits a chunk); the Triton backend sizes its own tiles.
        backend: ``"auto"`` (Triton for bf16/fp16 on a CUDA GPU it has tiles for, else torch),
            ``"torch"`` or ``"triton"``.
        batch_invariant: each token's results and hidden-state gradient bitwise independent
            of the other tokens in the call (the default; False opts out, faster only where
            fixed blocks or padding remain: the torch backend, a recomputed truncation, kept
            sets and wide id sets, and past 2 tensor-parallel ranks; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).
        kept_set: None (the full vocabulary), ``"replay"`` (renormalise over the rollout's
            sampling mask, :meth:`sampling_mask`) or a
            :class:`~mcore_hooks.kernels.Truncation` (top-k / top-p / min-p recomputed from these
            logits): the log-probs and entropies are then of the distribution the rollout
            sampled from.
    """

    def __init__(
        self,
        *,
        as_tuple: bool = False,
        temperature: Union[float, torch.Tensor] = 1.0,
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        backend: str = "auto",
        batch_invariant: bool = True,
        kept_set: KeptSet = None,
    ) -> None:
        _check_flag("as_tuple", as_tuple)
        self._set_options(temperature, ignore_index, chunk_size, backend, batch_invariant)
        _check_kept_set(kept_set)
        self.as_tuple = as_tuple
        self.kept_set = kept_set

    def process(self, ctx: PostprocessContext) -> Union[dict, tuple]:
        r, bs, _ = self.compute(ctx)
        logprobs, entropy = self.to_bs(r.logprob, bs), self.to_bs(r.entropy, bs)
        if self.as_tuple:
            return logprobs, entropy
        out = {"logprobs": logprobs, "entropy": entropy}
        if r.label_outside is not None:
            out["label_outside"] = self.to_bs(r.label_outside, bs)
        return out
