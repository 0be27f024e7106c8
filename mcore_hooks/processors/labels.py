"""Turning the hook's ``[b, s]`` / packed THD tensors into per-token vectors and back.

Everything here stays on the device: no value is read on the host (no synchronisation), so the
per-sequence work of packed batches is done with masks and ``bucketize`` rather than indexing by
boundary values.

Context parallelism: Megatron keeps ``cu_seqlens(_padded)`` *global* while each CP rank holds
``1 / cp`` of every (padded) sequence: the sequence is cut into ``2 cp`` equal chunks and rank
``r`` holds chunks ``r`` and ``2 cp - 1 - r``, one after the other (its load-balanced layout,
``get_batch_on_this_cp_rank`` / TE's ``thd_get_partitioned_indices``; Megatron's own
``_roll_tensor_packed_seq`` divides the offsets by ``cp`` the same way). So this rank's
sequence ``i`` starts at ``offsets[i] / cp`` of its local tokens. A ``[b, s]`` batch is the same
layout with one sequence per row.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..debug import check_values


def is_thd(packed_seq_params: Any) -> bool:
    """Whether the batch is packed (THD): its tokens' sequences are then known on the device."""
    return getattr(packed_seq_params, "qkv_format", None) == "thd"


_is_thd = is_thd


def _packed_offsets(packed_seq_params: Any, device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Global ``(offsets, lengths)`` of the packed sequences of a THD batch (None otherwise):
    sequence ``i`` occupies global positions ``[offsets[i], offsets[i + 1])``, padding included
    (``cu_seqlens_q_padded`` when given), and has ``lengths[i]`` real tokens."""
    if not _is_thd(packed_seq_params):
        return None
    cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.long)
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    offsets = cu if padded is None else padded.to(device=device, dtype=torch.long)
    return offsets, cu[1:] - cu[:-1]


def _sequence_of(pos: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The packed sequence each position belongs to (the last one for trailing padding)."""
    return torch.bucketize(pos, offsets[1:], right=True).clamp(max=offsets.shape[0] - 2)


def _check_cp_layout(offsets: torch.Tensor, total: int, cp_size: int) -> None:
    """Megatron's CP layout of packed sequences, where it can be checked without a host sync
    (CPU tensors, or debug checks on): every padded length a multiple of ``2 cp``, the sequences
    covering the batch. Otherwise ranks would claim the same positions."""
    if cp_size == 1 or not check_values(offsets):
        return
    lengths = offsets[1:] - offsets[:-1]
    if bool((lengths % (2 * cp_size) != 0).any()) or int(offsets[-1]) != total:
        raise ValueError(
            f"packed_seq_params: under context parallelism (cp={cp_size}) each packed sequence's "
            f"padded length must be a multiple of 2*cp = {2 * cp_size} and the sequences must "
            f"cover all {total} tokens, as Megatron pads them (cu_seqlens_q_padded); got padded "
            f"lengths {lengths.tolist()}"
        )


def cp_global_positions(
    local_len: int, cp_rank: int, cp_size: int, packed_seq_params: Any, device: torch.device
) -> torch.Tensor:
    """The global position of each of this CP rank's ``local_len`` tokens along the sequence
    dimension (``[local_len]`` long), in Megatron's load-balanced layout (module docstring): per
    packed sequence for THD input, else for the whole row."""
    local = torch.arange(local_len, device=device)
    if cp_size == 1:
        return local
    found = _packed_offsets(packed_seq_params, device)
    offsets = (found[0] if found is not None
               else torch.tensor([0, local_len * cp_size], device=device, dtype=torch.long))
    _check_cp_layout(offsets, local_len * cp_size, cp_size)
    local_offsets = offsets // cp_size
    seq = _sequence_of(local, local_offsets)
    chunk = (offsets[1:] - offsets[:-1])[seq] // (2 * cp_size)  # each sequence's chunk length
    q = local - local_offsets[seq]
    second = q >= chunk  # this rank's second chunk of the sequence: 2 cp - 1 - r
    k = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return offsets[seq] + k * chunk + torch.where(second, q - chunk, q)


def labels_from_input_ids(
    input_ids: torch.Tensor, ignore_index: int, packed_seq_params: Any = None
) -> torch.Tensor:
    """Next-token labels ``[b, s]``: ``input_ids`` rolled left by one, last position ignored.

    For packed THD input (``input_ids`` ``[1, T]`` holding several sequences) the roll is per
    sequence, by ``packed_seq_params`` (``cu_seqlens_q``, and ``cu_seqlens_q_padded`` where the
    sequences are padded), so no label crosses a sequence boundary; each sequence's last token and
    any padding are ignored. ``input_ids`` is the whole sequence (not a CP shard).
    """
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    found = _packed_offsets(packed_seq_params, input_ids.device)
    if found is None:
        labels[..., -1:] = ignore_index  # (a slice: no position at all is no error)
        return labels
    offsets, lengths = found
    pos = torch.arange(input_ids.shape[-1], device=input_ids.device)
    seq = _sequence_of(pos, offsets)
    has_next = (pos + 1 < offsets[seq] + lengths[seq]) & (pos < offsets[-1])
    return torch.where(has_next, labels, ignore_index)


def per_token_temperature(
    temperature: Union[float, torch.Tensor], batch: int, seq: int, packed_seq_params: Any = None,
    cp_size: int = 1, device: Optional[torch.device] = None,
) -> Union[float, torch.Tensor]:
    """A float, or a tensor of temperatures as one per token in ``[s, b]`` order: ``[b]`` one per
    sample, or ``[b, s]`` one per token (aligned with the labels: this rank's shard under context
    parallelism), for a caller that lays them out itself.

    For packed THD input a sample is a packed sequence: ``[num_sequences]`` temperatures are
    spread over each sequence's positions (padding included, the trailing padding taking the last
    sequence's: those positions carry no label). ``seq`` is this rank's token count (CP-local).
    The result is on ``device`` (the hidden states'): a CPU temperature tensor is copied there,
    host to device, rather than the device's ``cu_seqlens`` read back to the host.
    """
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 2:
        if tuple(temperature.shape) != (batch, seq):
            raise ValueError(
                f"temperature: one per token must have the labels' shape ({batch}, {seq}), got "
                f"{tuple(temperature.shape)}"
            )
        return temperature.to(device).t().reshape(-1)
    return per_request("temperature", temperature, batch, seq, packed_seq_params, cp_size, device)


def per_request(
    name: str, value: Any, batch: int, seq: int, packed_seq_params: Any = None, cp_size: int = 1,
    device: Optional[torch.device] = None,
) -> Any:
    """One value as it is, or one per request (per sample; per packed sequence for THD input:
    a list or a 1-D tensor) as one per token in ``[s, b]`` order on ``device``
    (:func:`per_token_temperature`'s rule); errors name ``name``."""
    if isinstance(value, (list, tuple)):
        value = torch.tensor(value)
    if not isinstance(value, torch.Tensor):
        return value
    if device is not None:
        value = value.to(device)
    if value.dim() != 1:
        raise ValueError(f"{name}: expected one value or a 1-D tensor, got shape {tuple(value.shape)}")
    ids, num_sequences = sequence_index(batch, seq, packed_seq_params, value.device, cp_size)
    if value.shape[0] != num_sequences:
        per = "packed sequence" if batch == 1 and _is_thd(packed_seq_params) else "sample"
        raise ValueError(f"{name}: expected one per {per} ({num_sequences}), got {value.shape[0]}")
    return value[ids.t().reshape(-1)]  # [s, b] order, like the tokens'



def sequence_index(
    batch: int, seq: int, packed_seq_params: Any, device: torch.device, cp_size: int = 1
) -> tuple[torch.Tensor, int]:
    """The sequence of each ``[b, s]`` position and how many sequences there are: the batch row,
    or for packed THD input (``b == 1``) the packed sequence (trailing padding taking the last).
    ``s`` is this rank's token count: under context parallelism each rank holds ``1 / cp`` of
    every padded sequence, so its local offsets are the global ones over ``cp``. The count is a
    shape, never a device value read on the host."""
    found = _packed_offsets(packed_seq_params, device)
    if found is not None and batch == 1:
        _check_cp_layout(found[0], seq * cp_size, cp_size)
        offsets = found[0] // cp_size
        pos = torch.arange(seq, device=device)
        return _sequence_of(pos, offsets).unsqueeze(0), offsets.shape[0] - 1
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)
    return rows, batch
