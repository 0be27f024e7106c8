"""Turning the hook's ``[b, s]`` / packed THD tensors into per-token vectors and back."""

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
    sequence, by ``packed_seq_params.cu_seqlens_q``, so no label crosses a sequence boundary.
    """
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    bounds = _packed_bounds(packed_seq_params)
    if bounds is None:
        labels[..., -1] = ignore_index
        return labels
    ends = bounds[1:].to(device=input_ids.device, dtype=torch.long) - 1
    ends = ends[(ends >= 0) & (ends < input_ids.shape[-1])]
    labels[..., ends] = ignore_index
    labels[..., bounds[-1].item():] = ignore_index  # padding after the last sequence
    return labels


def per_token_temperature(
    temperature: Union[float, torch.Tensor], batch: int, seq: int, packed_seq_params: Any = None
) -> Union[float, torch.Tensor]:
    """A float, or ``[b]`` per-sample temperatures as one per token in ``[s, b]`` order.

    For packed THD input a sample is a packed sequence: ``[num_sequences]`` temperatures are
    spread over each sequence's tokens.
    """
    if not isinstance(temperature, torch.Tensor):
        return temperature
    if temperature.dim() != 1:
        raise ValueError(f"temperature: expected a float or a 1-D tensor, got shape {tuple(temperature.shape)}")
    bounds = _packed_bounds(packed_seq_params)
    if bounds is not None and batch == 1:
        lengths = (bounds[1:] - bounds[:-1]).to(device=temperature.device, dtype=torch.long)
        if temperature.shape[0] != lengths.shape[0]:
            raise ValueError(
                f"temperature: expected one per packed sequence ({lengths.shape[0]}), got "
                f"{temperature.shape[0]}"
            )
        t = torch.repeat_interleave(temperature, lengths)
        if t.shape[0] < seq:  # padding after the last sequence: any positive value, it is masked
            t = torch.cat([t, t.new_ones(seq - t.shape[0])])
        return t[:seq]
    if temperature.shape[0] != batch:
        raise ValueError(f"temperature: expected one per sample ({batch}), got {temperature.shape[0]}")
    return temperature.unsqueeze(0).expand(seq, batch).reshape(-1)
