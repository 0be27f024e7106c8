"""Each framework's own call shape, end to end: its packing helper's output, its argument names and
labels convention, the model call with the integration's processor, and its post-processing of
the result, against the framework's own unfused formula on the stock model's logits (values, and
every parameter's gradient of an objective over the positions the framework keeps).

Written from the frameworks' code (verl ``1dda039``: ``verl/models/mcore/model_forward_fused.py``,
``util.py`` ``preprocess_thd_engine`` / ``postprocess_thd_engine``,
``workers/engine/megatron/transformer_impl.py``; NeMo RL ``7ea279a``:
``nemo_rl/models/megatron/train.py`` ``model_forward``, ``data.py``
``_pack_sequences_for_megatron``, ``distributed/model_utils.py``
``from_parallel_logits_to_logprobs(_packed_sequences)``), one tensor-parallel rank, float32: the
two sides differ by float32 summation order, 1e-5 relative to the O(1) values.

One departure from both: the tiny CPU models have learned absolute position embeddings, so the
packed calls pass each sequence's positions where the frameworks (whose models use RoPE) pass
``position_ids=None``.
"""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import enable_output_processor
from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
from mcore_hooks.integrations.verl import FusedOutputProcessorContext, VerlFusedProcessor
from mcore_hooks.testing import TinyModelConfig, build_tiny_model, supports_packed_sequences

pytestmark = pytest.mark.usefixtures("mp1")

LENGTHS = (5, 7, 4)
T = 0.7


def _pair(cfg):
    return build_tiny_model(cfg), enable_output_processor(build_tiny_model(cfg))  # same weights


def _sequences(cfg, lengths=LENGTHS):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in lengths]


def _packed_params(cu_padded: torch.Tensor, max_len: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    # both frameworks pass the padded offsets as cu_seqlens_q/kv too
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded.clone(),
                           cu_seqlens_q_padded=cu_padded.clone(), cu_seqlens_kv_padded=cu_padded.clone(),
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare_grads(ours, stock):
    assert ours.keys() == stock.keys()
    for name in stock:
        torch.testing.assert_close(ours[name], stock[name], rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- verl


def _verl_pack(seqs, tp=1, cp=1):
    """``preprocess_thd_engine`` (zigzag layout, CP 1): each sequence padded with 0 to a multiple of
    ``tp * cp * (2 if cp > 1 else 1)``, concatenated into ``[1, T]``; its labels (``need_roll``)
    the same buffer rolled left by one, across sequence boundaries."""
    align = tp * cp * (2 if cp > 1 else 1)
    padded = [n + (align - n % align) % align for n in map(len, seqs)]
    buf = torch.zeros(sum(padded), dtype=torch.long)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(padded, dtype=torch.int32), 0)
    for s, start in zip(seqs, cu[:-1].tolist()):
        buf[start:start + len(s)] = s
    input_ids = buf.unsqueeze(0)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    return input_ids, labels, cu, max(padded)


def _verl_kept(values: torch.Tensor, cu: torch.Tensor, lengths) -> torch.Tensor:
    """``postprocess_thd_engine`` (each sequence's real tokens), then what the loss reads of
    each: all but its last position, whose label is not its next token."""
    return torch.cat([values[int(start):int(start) + n - 1] for start, n in zip(cu[:-1], lengths)])


def test_verl_engine_call_shape():
    if not supports_packed_sequences("gpt"):
        pytest.skip("no packed sequences on this release")
    cfg = TinyModelConfig(tied=False)
    stock, model = _pair(cfg)
    seqs = _sequences(cfg)
    input_ids, labels, cu, max_len = _verl_pack(seqs)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    call = dict(input_ids=input_ids, attention_mask=None, position_ids=positions,
                packed_seq_params=_packed_params(cu, max_len))
    adv = torch.randn(sum(LENGTHS) - len(LENGTHS), generator=torch.Generator().manual_seed(3))

    out = model(**call, labels=labels, output_processor=VerlFusedProcessor(),
                output_processor_context=FusedOutputProcessorContext(temperature=T))
    assert out.log_probs.shape == (input_ids.numel(),)  # 1-D over the packed tokens
    lp, ent = _verl_kept(out.log_probs, cu, LENGTHS), _verl_kept(out.entropy, cu, LENGTHS)
    (-(adv * lp).sum() - 0.01 * ent.sum()).backward()

    # verl's non-fused path: logits.div_(temperature), log_softmax, gather at the rolled labels
    logits = stock(**call).float()[0] / T
    logp = torch.log_softmax(logits, -1)
    ref_lp = _verl_kept(logp.gather(-1, labels[0].unsqueeze(-1)).squeeze(-1), cu, LENGTHS)
    ref_ent = _verl_kept(-(logp.exp() * logp).sum(-1), cu, LENGTHS)
    (-(adv * ref_lp).sum() - 0.01 * ref_ent.sum()).backward()

    torch.testing.assert_close(lp.detach(), ref_lp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-5, atol=1e-6)
    _compare_grads(_grads(model), _grads(stock))


# --------------------------------------------------------------------------- NeMo RL


def _nemo_pack(seqs, pad_to_multiple_of):
    """``_pack_sequences_for_megatron`` (CP 1): each sequence right-padded with 0 to a multiple of
    ``make_sequence_length_divisible_by``, ``cu_seqlens`` / ``cu_seqlens_padded`` int32, the
    padded offsets passed as ``cu_seqlens_q`` too."""
    padded = [-(-len(s) // pad_to_multiple_of) * pad_to_multiple_of for s in seqs]
    cu_p = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_p[1:] = torch.cumsum(torch.tensor(padded, dtype=torch.int32), 0)
    buf = torch.zeros(int(cu_p[-1]), dtype=torch.long)
    for s, start in zip(seqs, cu_p[:-1].tolist()):
        buf[start:start + len(s)] = s
    return buf.unsqueeze(0), cu_p, max(padded)


def _nemo_unpacked_logprobs(logits: torch.Tensor, all_ids: torch.Tensor, cu_p, width: int) -> torch.Tensor:
    """``from_parallel_logits_to_logprobs_packed_sequences`` (TP 1, CP 1) after ``logits.div_(T)``:
    per sequence, its padded slice's targets rolled left within it, log-softmax, and
    ``out[i, :n] = logprobs[start:end - 1][:n]`` with ``n = min(padded_len - 1, width - 1)``."""
    out = torch.zeros(len(cu_p) - 1, width - 1)
    logp = torch.log_softmax(logits.float(), -1)
    for i, (start, end) in enumerate(zip(cu_p[:-1].tolist(), cu_p[1:].tolist())):
        target = all_ids[start:end].roll(-1)
        lp = logp[start:end].gather(-1, target.unsqueeze(-1)).squeeze(-1)
        n = min(end - start - 1, width - 1)
        out[i, :n] = lp[:-1][:n]
    return out


def test_nemo_rl_packed_call_shape():
    """NeMo RL's packed micro-batch (``make_sequence_length_divisible_by=4``): its model call with
    ``labels`` the packed ``input_ids``, the processor's ``[1, T-1]`` read back per sequence as
    NeMo RL's loss reads ``[B, S-1]``; its real tokens' log-probs (the padding's are masked)."""
    if not supports_packed_sequences("gpt"):
        pytest.skip("no packed sequences on this release")
    cfg = TinyModelConfig(tied=True)
    stock, model = _pair(cfg)
    seqs = _sequences(cfg)
    input_ids, cu_p, max_len = _nemo_pack(seqs, 4)
    positions = torch.cat([torch.arange(int(e - s)) for s, e in zip(cu_p[:-1], cu_p[1:])]).unsqueeze(0)
    call = dict(input_ids=input_ids, position_ids=positions, attention_mask=None,
                packed_seq_params=_packed_params(cu_p, max_len))
    width = max(LENGTHS)
    mask = torch.zeros(len(LENGTHS), width - 1)  # token_mask: each sequence's real next tokens
    for i, n in enumerate(LENGTHS):
        mask[i, :n - 1] = 1.0
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) * mask

    out = model(**call, labels=input_ids, output_processor=NemoRLLogprobProcessor(temperature=T))
    assert out.shape == (1, input_ids.shape[1] - 1)
    ours = torch.zeros(len(LENGTHS), width - 1)
    for i, (start, n) in enumerate(zip(cu_p[:-1].tolist(), LENGTHS)):
        ours[i, :n - 1] = out[0, start:start + n - 1]
    (ours * w).sum().backward()

    logits = stock(**call)[0] / T  # train.py: logits.div_(temperature) before the log-probs
    ref = _nemo_unpacked_logprobs(logits, input_ids[0], cu_p, width)
    (ref * w).sum().backward()
    torch.testing.assert_close(ours.detach() * mask, ref.detach() * mask, rtol=1e-5, atol=1e-6)
    _compare_grads(_grads(model), _grads(stock))


def test_nemo_rl_unpacked_call_shape():
    """NeMo RL's ``[B, S]`` micro-batch: ``model(input_ids=, position_ids=, attention_mask=,
    labels=input_ids)`` (Megatron's causal mask and ``arange`` positions), ``[B, S-1]`` back,
    against ``from_parallel_logits_to_logprobs`` (targets rolled left, ``[:, :-1]``)."""
    cfg = TinyModelConfig(tied=False)
    stock, model = _pair(cfg)
    b, s = 3, 12
    ids = torch.randint(1, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(8))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).expand(1, 1, s, s)  # True: masked
    call = dict(input_ids=ids, position_ids=torch.arange(s).expand(b, s), attention_mask=causal)
    w = torch.rand(b, s - 1, generator=torch.Generator().manual_seed(9))

    out = model(**call, labels=ids, output_processor=NemoRLLogprobProcessor(temperature=T))
    (out * w).sum().backward()
    logp = torch.log_softmax(stock(**call).float() / T, -1)
    ref = logp.gather(-1, ids.roll(-1, dims=-1).unsqueeze(-1)).squeeze(-1)[:, :-1]
    (ref * w).sum().backward()
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    _compare_grads(_grads(model), _grads(stock))
