"""A rollout engine's sampling masks as the rows the processors take (``kept_set="replay"``).

The formats, as read in the engines' released code (vLLM 0.28.0-0.33.0, SGLang 0.5.23):

* **vLLM** (first in 0.28.0; ``--return-sampling-mask``, Model Runner V2 (its default in 0.33),
  ``logprobs_mode="processed_logprobs"``, every request ``temperature > 0`` and ``top_k > 0``):
  ``RequestOutput.outputs[i].sampling_mask`` is ``vllm.outputs.SamplingMask`` with
  ``token_ids: list[list[int]]``, one list per generated token, ascending ids: every token whose
  logit was finite after temperature, min-p, top-k and top-p, the sampled one always among them.
  A row can be wider than ``top_k`` (a rule that keeps ties of the ``k``-th value). Its internal
  CSR form, ``SamplingMaskLists`` (``token_ids`` flat, ``offsets`` of ``len + 1``; ``offsets``
  None for one position, since 0.30.0), is taken too.
* **SGLang** (``return_sampling_mask=True`` per request; ``top_k`` 1, or within
  ``--sampling-mask-max-tokens``, 4096 by default: a wider support aborts the request):
  ``meta_info["output_token_sampling_mask"]``, ``list[list[int]]`` per output token, ordered by
  descending probability (order does not matter here: a set).

Row ``t`` is the set the ``t``-th generated token was sampled from, so it goes where the labels
hold that token: for a response starting at position ``P`` of its sequence, row ``t`` at
position ``P + t - 1`` (the label of position ``j`` is token ``j + 1``), exactly where the
rollout's log-probs (``old_logprobs``) go.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

__all__ = ["sampling_mask_ids"]


def _rows(mask: Any) -> list[Sequence[int]]:
    ids = getattr(mask, "token_ids", mask)
    offsets = getattr(mask, "offsets", None)
    if offsets is None and hasattr(mask, "offsets") and _is_flat(ids):
        # vLLM's SamplingMaskLists for one position: offsets None, token_ids that position's ids
        return [[int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]]
    if offsets is not None:
        flat = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        off = [int(o) for o in (offsets.tolist() if hasattr(offsets, "tolist") else offsets)]
        if not off or off[0] != 0 or off[-1] != len(flat) or any(b < a for a, b in zip(off, off[1:])):
            raise ValueError(
                f"sampling mask: CSR offsets must start at 0, not decrease and end at len(token_ids) "
                f"= {len(flat)}, got {off[:4]}...{off[-2:]}")
        return [flat[a:b] for a, b in zip(off, off[1:])]
    if not _is_rows(ids):
        raise TypeError(
            "sampling mask: expected vLLM's SamplingMask (token_ids: list[list[int]], or CSR "
            "token_ids + offsets), or SGLang's output_token_sampling_mask (list[list[int]]), got "
            f"{type(mask).__name__}")
    return list(ids)


def _is_flat(x: Any) -> bool:
    if hasattr(x, "tolist") and hasattr(x, "ndim"):  # an array or tensor
        return x.ndim == 1
    return isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _is_rows(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in x)


def sampling_mask_ids(
    mask: Any, *, width: Optional[int] = None, device: Union[str, torch.device, None] = None,
) -> torch.Tensor:
    """One generated sequence's sampling mask as ``[T, K]`` long ids, each row ascending and
    padded with -1 (the ``kept_ids`` / ``sampling_mask`` form).

    Args:
        mask: vLLM's ``SamplingMask`` (``token_ids`` as a list of lists) or ``SamplingMaskLists``
            (``token_ids`` flat with ``offsets``, or ``offsets`` None for one position: any
            object with those attributes, lists, arrays or tensors), or SGLang's
            ``output_token_sampling_mask`` (a list of lists).
        width: ``K`` (default: the longest row), so that sequences stack into ``[b, s, K]``:
            take the widest row of the batch, not the request's ``top_k`` (vLLM's rows can be
            wider), or one fixed width for batch invariance.
        device: where the tensor goes.

    Returns:
        ``[T, K]`` long: row ``t`` the ids generated token ``t`` was sampled from.

    Raises:
        ValueError: an empty row (every sampler keeps at least its sampled token), a negative
            or repeated id, a row longer than ``width``, or malformed CSR offsets.
        TypeError: an unknown format.
    """
    rows = _rows(mask)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    flat = torch.tensor([int(i) for r in rows for i in r], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    bad_row = (lengths == 0).nonzero()
    if bad_row.numel() or (flat < 0).any():
        t = int(bad_row[0]) if bad_row.numel() else int(row[flat < 0][0])
        raise ValueError(f"sampling mask: row {t} must hold non-negative ids, at least the sampled "
                         f"one; got {list(rows[t])[:8]}")
    longest = int(lengths.max()) if rows else 0
    k = max(1, longest) if width is None else width
    if isinstance(k, bool) or not isinstance(k, int) or k < max(1, longest):
        raise ValueError(f"width: expected an int >= the longest row ({longest}) and >= 1, got {width!r}")
    # ascending within each row: sort by (row, id)
    span = int(flat.max()) + 1 if flat.numel() else 1
    key, order = (row * span + flat).sort()
    dup = (key[1:] == key[:-1]).nonzero()
    if dup.numel():
        t = int(row[order[int(dup[0])]])
        raise ValueError(f"sampling mask: row {t} repeats id {int(flat[order[int(dup[0])]])}")
    starts = torch.cumsum(lengths, 0) - lengths
    out = torch.full((len(rows), k), -1, dtype=torch.long)
    sorted_row = row[order]
    out[sorted_row, torch.arange(flat.numel()) - starts[sorted_row]] = flat[order]
    return out.to(device) if device is not None else out
