"""Turning the hook's ``[b, s]`` / packed THD tensors into per-token vectors and back.

Everything here stays on the device: no value is read on the host (no synchronisation), so the
per-sequence work of packed batches is done with masks and ``bucketize`` rather than indexing by
boundary values.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch


def _packed_bounds(packed_seq_params: Any) -> Optional[torch.Tensor]:
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return None
    return packed_seq_params.cu_seqlens_q


def labels_from_input_ids(
    input_ids: torch.Tensor, ignore_index: int, packed_seq_params: Any = None
) -> torch.Tensor:
    """Next-token labels ``[b, s]``: ``input_ids`` rolled left by one, last position ignored.

    For packed THD input (``input_ids`` ``[1, T]`` holding several sequences) the roll is per
    sequence, by ``packed_seq_params.cu_seqlens_q``, so no label crosses a sequence boundary; the
    padding after the last sequence is ignored too.
    """
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    bounds = _packed_bounds(packed_seq_params)
    if bounds is None:
        labels[..., -1] = ignore_index
        return labels
    bounds = bounds.to(device=input_ids.device, dtype=torch.long)
    pos = torch.arange(input_ids.shape[-1], device=input_ids.device)
    last_of_a_sequence = torch.isin(pos + 1, bounds[1:])
    padding = pos >= bounds[-1]
    return torch.where(last_of_a_sequence | padding, ignore_index, labels)


def per_token_temperature(
    temperature: Union[float, torch.Tensor], batch: int, seq: int, packed_seq_params: Any = None
) -> Union[float, torch.Tensor]:
    """A float, or ``[b]`` per-sample temperatures as one per token in ``[s, b]`` order.

    For packed THD input a sample is a packed sequence: ``[num_sequences]`` temperatures are
    spread over each sequence's tokens (the padding after the last sequence takes the last one's:
    its positions carry no label).
    """
    if not isinstance(temperature, torch.Tensor):
        return temperature
    if temperature.dim() != 1:
        raise ValueError(f"temperature: expected a float or a 1-D tensor, got shape {tuple(temperature.shape)}")
    bounds = _packed_bounds(packed_seq_params)
    if bounds is not None and batch == 1:
        num_sequences = bounds.shape[0] - 1
        if temperature.shape[0] != num_sequences:
            raise ValueError(
                f"temperature: expected one per packed sequence ({num_sequences}), got "
                f"{temperature.shape[0]}"
            )
        pos = torch.arange(seq, device=temperature.device)
        sequence = torch.bucketize(pos, bounds[1:].to(device=pos.device, dtype=pos.dtype), right=True)
        return temperature[sequence.clamp(max=num_sequences - 1)]
    if temperature.shape[0] != batch:
        raise ValueError(f"temperature: expected one per sample ({batch}), got {temperature.shape[0]}")
    return temperature.unsqueeze(0).expand(seq, batch).reshape(-1)
