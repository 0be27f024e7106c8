"""Turning the hook's ``[b, s]`` / packed THD tensors into per-token vectors and back.

Everything here stays on the device: no value is read on the host (no synchronisation), so the
per-sequence work of packed batches is done with masks and ``bucketize`` rather than indexing by
boundary values.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch


def _packed_layout(packed_seq_params: Any, device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(offsets, real_ends)`` of the packed sequences in a THD batch, as ``[n + 1]`` and ``[n]``
    long tensors: sequence ``i`` occupies positions ``[offsets[i], offsets[i + 1])`` (padding
    included, ``cu_seqlens_q_padded`` when given) and its tokens end at ``real_ends[i]``."""
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return None
    cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.long)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    offsets = cu if padded is None else padded.to(device=device, dtype=torch.long)
    return offsets, offsets[:-1] + (cu[1:] - cu[:-1])


def _sequence_of(pos: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The packed sequence each position belongs to (the last one for trailing padding)."""
    return torch.bucketize(pos, offsets[1:], right=True).clamp(max=offsets.shape[0] - 2)


def labels_from_input_ids(
    input_ids: torch.Tensor, ignore_index: int, packed_seq_params: Any = None
) -> torch.Tensor:
    """Next-token labels ``[b, s]``: ``input_ids`` rolled left by one, last position ignored.

    For packed THD input (``input_ids`` ``[1, T]`` holding several sequences) the roll is per
    sequence, by ``packed_seq_params`` (``cu_seqlens_q``, and ``cu_seqlens_q_padded`` where the
    sequences are padded), so no label crosses a sequence boundary; each sequence's last token and
    any padding are ignored.
    """
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    layout = _packed_layout(packed_seq_params, input_ids.device)
    if layout is None:
        labels[..., -1] = ignore_index
        return labels
    offsets, real_ends = layout
    pos = torch.arange(input_ids.shape[-1], device=input_ids.device)
    has_next = (pos + 1 < real_ends[_sequence_of(pos, offsets)]) & (pos < offsets[-1])
    return torch.where(has_next, labels, ignore_index)


def per_token_temperature(
    temperature: Union[float, torch.Tensor], batch: int, seq: int, packed_seq_params: Any = None
) -> Union[float, torch.Tensor]:
    """A float, or ``[b]`` per-sample temperatures as one per token in ``[s, b]`` order.

    For packed THD input a sample is a packed sequence: ``[num_sequences]`` temperatures are
    spread over each sequence's positions (padding included, the trailing padding taking the last
    sequence's: those positions carry no label).
    """
    if not isinstance(temperature, torch.Tensor):
        return temperature
    if temperature.dim() != 1:
        raise ValueError(f"temperature: expected a float or a 1-D tensor, got shape {tuple(temperature.shape)}")
    layout = _packed_layout(packed_seq_params, temperature.device)
    if layout is not None and batch == 1:
        offsets = layout[0]
        num_sequences = offsets.shape[0] - 1
        if temperature.shape[0] != num_sequences:
            raise ValueError(
                f"temperature: expected one per packed sequence ({num_sequences}), got "
                f"{temperature.shape[0]}"
            )
        return temperature[_sequence_of(torch.arange(seq, device=temperature.device), offsets)]
    if temperature.shape[0] != batch:
        raise ValueError(f"temperature: expected one per sample ({batch}), got {temperature.shape[0]}")
    return temperature.unsqueeze(0).expand(seq, batch).reshape(-1)


def sequence_index(batch: int, seq: int, packed_seq_params: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """The sequence of each ``[b, s]`` position and how many sequences there are: the batch row,
    or for packed THD input (``b == 1``) the packed sequence (trailing padding taking the last).
    The count is a shape, never a device value read on the host."""
    layout = _packed_layout(packed_seq_params, device)
    if layout is not None and batch == 1:
        offsets = layout[0]
        pos = torch.arange(seq, device=device)
        return _sequence_of(pos, offsets).unsqueeze(0), offsets.shape[0] - 1
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)
    return rows, batch
