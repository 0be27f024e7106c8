"""Context parallelism with packed (THD) sequences: every processor against the unsplit run.

Megatron keeps ``cu_seqlens(_padded)`` global under CP while each rank holds ``1 / cp`` of every
padded sequence (chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``). The shards here are cut by a loop
written from that description, independently of the library's index arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import FusedLogprobProcessor, LogprobEntropyProcessor, PolicyLossProcessor
from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
from mcore_hooks.kernels import PolicyLoss
from mcore_hooks.testing import hook_keywords, run_on_ranks

CP = 2
LENGTHS = [5, 8, 3]  # real tokens per sequence
PADDED = [8, 8, 4]  # each a multiple of 2 * CP, as Megatron pads packed sequences under CP
H, V = 16, 40
LOSS = PolicyLoss(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)


def _params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    cu_padded = torch.tensor([0] + torch.tensor(PADDED).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED))


def _positions(rank: int) -> list[int]:
    """The global positions rank ``rank`` holds, in its local order."""
    out, start = [], 0
    for padded in PADDED:
        c = padded // (2 * CP)
        for k in (rank, 2 * CP - 1 - rank):
            out += range(start + k * c, start + (k + 1) * c)
        start += padded
    return out


def _data():
    g = torch.Generator().manual_seed(11)
    t = sum(PADDED)
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(t, 1, H, generator=g)
    ids = torch.randint(0, V, (1, t), generator=g)
    labels = torch.randint(0, V, (1, t), generator=g)
    start = 0
    for n, padded in zip(LENGTHS, PADDED):  # each sequence's last token and padding: no label
        labels[0, start + n - 1 : start + padded] = -100
        start += padded
    temps = torch.tensor([0.7, 1.3, 0.9])
    inputs = {"old_logprobs": -torch.rand(1, t, generator=g) * 3, "advantages": torch.randn(1, t, generator=g)}
    return layer, hidden, ids, labels, temps, inputs


def _run(processor, layer, hidden, pos, group, **kw):
    """The processor on the tokens at ``pos`` (all: unsplit); its output and the gradients of
    ``sum`` of its (first) output."""
    h = hidden[pos].clone().requires_grad_()
    layer.zero_grad()
    sliced = {k: (v[:, pos] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if "context" in kw:
        sliced["context"] = {k: v[:, pos] for k, v in kw["context"].items()}
    out = processor(**hook_keywords(h, layer, cp_group=group, packed_seq_params=_params(), **sliced))
    first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out["loss"]
    first.sum().backward()
    return out, h.grad, layer.weight.grad.clone()


def _check(which: str, mode: str):
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    layer, hidden, ids, labels, temps, inputs = _data()
    pos, full = _positions(rank), list(range(hidden.shape[0]))
    if which == "logprob":
        make = lambda: FusedLogprobProcessor(temperature=temps)  # noqa: E731
        kw = dict(labels=labels)
    elif which == "entropy":
        make = lambda: LogprobEntropyProcessor(temperature=temps, as_tuple=True)  # noqa: E731
        kw = dict(labels=labels)
    elif which == "policy":
        make = lambda: PolicyLossProcessor(loss=LOSS, aggregation=mode, temperature=temps)  # noqa: E731
        kw = dict(labels=labels, context=inputs)
    else:  # NeMo RL: labels=input_ids, unshifted
        make = lambda: NemoRLLogprobProcessor(temperature=temps)  # noqa: E731
        kw = dict(labels=ids)
    local, dh, dw = _run(make(), layer, hidden, pos, group, **kw)
    dist.all_reduce(dw, group=group)
    ref, dh_ref, dw_ref = _run(make(), layer, hidden, full, None, **kw)
    return local, ref, dh, dh_ref[pos], dw, dw_ref


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out["loss"]


# fp32 sums of a few tens of O(1) terms, in another order than the unsplit run's
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["logprob", "entropy"])
def test_per_token_results_with_per_sequence_temperature(which):
    for rank, (local, ref, dh, dh_ref, dw, dw_ref) in enumerate(run_on_ranks(_check, CP, which, None, tp=1, cp=CP)):
        pos = _positions(rank)
        for a, b in zip((local,) if isinstance(local, torch.Tensor) else local,
                        (ref,) if isinstance(ref, torch.Tensor) else ref):
            torch.testing.assert_close(a, b[:, pos], **TOL)
        torch.testing.assert_close(dh, dh_ref, **TOL)
        torch.testing.assert_close(dw, dw_ref, **TOL)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_aggregations_are_the_whole_batch(mode):
    for rank, (local, ref, dh, dh_ref, dw, dw_ref) in enumerate(run_on_ranks(_check, CP, "policy", mode, tp=1, cp=CP)):
        torch.testing.assert_close(local["loss"], ref["loss"], **TOL)
        torch.testing.assert_close(local["logprobs"], ref["logprobs"][:, _positions(rank)], **TOL)
        torch.testing.assert_close(dh, dh_ref, **TOL)
        torch.testing.assert_close(dw, dw_ref, **TOL)


def test_nemo_rl_packed_under_context_parallelism():
    """The whole ``[1, T-1]`` on every rank, labels rolled within each sequence across the CP
    chunks; the gradient NeMo RL's all-gather gives (the CP all-reduce of every rank's loss)."""
    for local, ref, dh, dh_ref, dw, dw_ref in run_on_ranks(_check, CP, "nemo", None, tp=1, cp=CP):
        torch.testing.assert_close(local, ref, **TOL)
        torch.testing.assert_close(dh, CP * dh_ref, **TOL)
        torch.testing.assert_close(dw, CP * dw_ref, **TOL)


def test_a_layout_that_is_not_megatrons_is_refused():
    """Padded lengths that are not multiples of 2 cp, or sequences that do not cover the batch,
    would make two ranks claim the same positions: refused, naming cu_seqlens_q_padded."""
    import types

    from mcore_hooks.processors.labels import cp_global_positions, sequence_index

    def params(padded):
        cu = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist())
        return types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)

    assert cp_global_positions(10, 1, CP, _params(), torch.device("cpu")).tolist() == _positions(1)
    for padded, local in (([6, 8], 7), ([8, 8], 10)):
        with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
            cp_global_positions(local, 0, CP, params(padded), torch.device("cpu"))
        with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
            sequence_index(1, local, params(padded), torch.device("cpu"), CP)
