"""A stand-in for Transformer Engine's context-parallel attention on CPU ranks, for the patch
series' tests (``test_verl_series.py``, ``test_nemo_rl_series.py``), whose frameworks run their
models with context parallelism: the CPU core attention of ``mcore_hooks.testing`` does not."""

from __future__ import annotations

import torch


class GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: this rank's rows of the summed gradient
    (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.rank], None


def cp_rows(cu_padded: list, cp: int, rank: int) -> tuple:
    """(sequence, position within it) of each row CP rank ``rank`` holds of a packed row: of every
    padded sequence, chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (Megatron's load-balanced
    layout, which verl and NeMo RL use; written here from that description, not from the
    frameworks' or the library's index arithmetic)."""
    seq, pos = [], []
    for i, (a, b) in enumerate(zip(cu_padded[:-1], cu_padded[1:])):
        chunk = (b - a) // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            seq += [i] * chunk
            pos += range(k * chunk, (k + 1) * chunk)
    return torch.tensor(seq), torch.tensor(pos)


class ContextParallelCoreAttention(torch.nn.Module):
    """Stands in for Transformer Engine's context-parallel attention (``TEDotProductAttention``
    with a CP group; CUDA only): packed THD input only. Each rank's queries attend, causally within
    their packed sequence, to the keys and values of every CP rank (all-gathered; their gradients
    go back to the rank that holds them), in Megatron's load-balanced layout; the same fp32 matmul
    and softmax as the CPU core attention. The frameworks' ``cu_seqlens`` are the padded ones, so
    padding positions are attended to as TE attends to them, after every real token (causal: no
    real token sees them)."""

    def __init__(self, inner: torch.nn.Module, group) -> None:
        super().__init__()
        import torch.distributed as dist

        self.inner, self.group = inner, group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        assert getattr(packed_seq_params, "qkv_format", None) == "thd", "packed THD input only"
        cu = packed_seq_params.cu_seqlens_q_padded.tolist()
        seq_q, pos_q = cp_rows(cu, self.cp, self.rank)
        rows = [cp_rows(cu, self.cp, r) for r in range(self.cp)]
        seq_k, pos_k = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        k, v = GatherRows.apply(key, self.group), GatherRows.apply(value, self.group)
        allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
        q, k, v = (x.permute(1, 0, 2).float() for x in (query, k, v))  # [np, t, hn]
        scale = self.inner.softmax_scale or 1.0 / q.size(-1) ** 0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
        return torch.matmul(probs, v).permute(1, 0, 2).reshape(query.size(0), -1).to(query.dtype)
