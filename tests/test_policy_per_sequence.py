"""GRPO's advantages, one per sequence (``[b]``; one per packed sequence of a packed THD batch),
given to PolicyLossProcessor: the same loss, log-probs and gradients, bit for bit, as the
``[b, s]`` broadcast of the same values (the kernel gets the same per-token inputs), through the
model's ``output_processor=`` on the tiny models, under sequence parallelism at TP 2, and under
context parallelism (this rank's slice of every sequence); per-token inputs refuse ``[b]``."""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import PolicyLossProcessor, hooked_class
from mcore_hooks.kernels import PolicyLoss, per_token_loss
from mcore_hooks.testing import (
    TinyModelConfig,
    build_tiny_model,
    hook_keywords,
    packed_sequence_slices,
    run_on_ranks,
    stock_model_class,
    supports_packed_sequences,
    tiny_batch,
)

pytestmark = pytest.mark.usefixtures("mp1")

LOSS = PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01)
MODES = ["token-mean", "seq-mean-token-mean"]


def _per_sequence_inputs(batch: dict, seed: int = 7) -> tuple[dict, dict]:
    """``(inputs with [n] advantages, the same with [b, s] advantages)``: ``n`` the batch rows,
    or the packed sequences of a packed batch (each broadcast over its own slice)."""
    labels = batch["labels"]
    g = torch.Generator().manual_seed(seed)
    packed = "packed_seq_params" in batch
    n = len(packed_sequence_slices(batch)) if packed else labels.shape[0]
    per_seq = torch.randn(n, generator=g)
    if packed:
        lengths = [sl.stop - sl.start for sl in packed_sequence_slices(batch)]
        per_token = per_seq.repeat_interleave(torch.tensor(lengths)).unsqueeze(0)
    else:
        per_token = per_seq[:, None].expand(labels.shape).clone()
    assert per_token.shape == labels.shape
    base = {"old_logprobs": -3.7 + 0.3 * torch.randn(labels.shape, generator=g),
            "ref_logprobs": -3.7 + 0.3 * torch.randn(labels.shape, generator=g)}
    return {**base, "advantages": per_seq}, {**base, "advantages": per_token}


def _loss_and_grads(model, batch, inputs, mode):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_processor=PolicyLossProcessor(loss=LOSS, aggregation=mode),
                output_processor_context=inputs)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out["loss"].detach(), out["logprobs"], out["entropy"], grads


def _bitwise_same(a, b) -> None:
    loss, lp, ent, grads = a
    loss_b, lp_b, ent_b, grads_b = b
    assert torch.equal(loss, loss_b), (loss, loss_b)
    assert torch.equal(lp, lp_b) and torch.equal(ent, ent_b)
    assert grads and grads.keys() == grads_b.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_b[name]), name


def _through_the_model(packed: bool, mode: str, sequence_parallel: bool = False) -> bool:
    cfg = TinyModelConfig(tied=False, sequence_parallel=sequence_parallel)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))
    batch = tiny_batch(cfg, packed=packed, batch_size=3)
    per_seq, broadcast = _per_sequence_inputs(batch)
    # a first forward+backward of a process may take another path in the CPU math libraries
    # (mcore_hooks.verify says so): one run first, then the two compared
    _loss_and_grads(model, batch, broadcast, mode)
    want = _loss_and_grads(model, batch, broadcast, mode)
    got = _loss_and_grads(model, batch, per_seq, mode)
    _bitwise_same(got, want)
    assert want[3]["output_layer.weight"].abs().sum() > 0  # the loss reached the head
    return True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_per_sequence_advantages_are_their_broadcast(packed, mode):
    if packed and not supports_packed_sequences("gpt"):
        pytest.skip("no packed sequences on this release's GPTModel")
    assert _through_the_model(packed, mode)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_per_sequence_advantages_under_sequence_parallel_tp2(packed):
    """Sequence parallel: each rank's hidden states are [s/tp, b, h], the labels and the
    advantages' broadcast the whole [b, s]."""
    if packed and not supports_packed_sequences("gpt"):
        pytest.skip("no packed sequences on this release's GPTModel")
    assert run_on_ranks(_through_the_model, 2, packed, "seq-mean-token-mean", True) == [True, True]


def _cp_case(packed: bool, mode: str):
    """CP=2 on the hook's keywords (the CPU models have no context-parallel attention): each
    rank holds its slice of every sequence (Megatron's load-balanced layout), the [b]
    advantages whole on every rank, against the broadcast cut to the same slice."""
    from megatron.core import parallel_state

    from test_cp_packed import _data, _params, _positions

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    layer, hidden, _, labels, _, inputs = _data()  # packed: [t, 1, h], labels [1, t]
    if packed:
        pos, params = _positions(rank), _params()
        cu = params.cu_seqlens_q_padded.long()
        per_seq = torch.tensor([0.9, -1.4, 0.3])
        per_token = per_seq.repeat_interleave(cu.diff()).unsqueeze(0)
    else:  # [b, s] rows, each cut in 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r
        b, s = 2, 8
        g = torch.Generator().manual_seed(12)
        hidden = torch.randn(s, b, hidden.shape[-1], generator=g)
        labels = torch.randint(0, layer.weight.shape[0], (b, s), generator=g)
        inputs = {"old_logprobs": -torch.rand(b, s, generator=g) * 3}
        c = s // 4
        pos, params = [*range(rank * c, (rank + 1) * c), *range((3 - rank) * c, (4 - rank) * c)], None
        per_seq = torch.tensor([0.9, -1.4])
        per_token = per_seq[:, None].expand(b, s).clone()

    def run(advantages):
        h = hidden[pos].clone().requires_grad_()
        layer.zero_grad()
        old = inputs["old_logprobs"][:, pos]
        context = {"old_logprobs": old, "ref_logprobs": old + 0.2, "advantages": advantages}
        out = PolicyLossProcessor(loss=LOSS, aggregation=mode)(**hook_keywords(
            h, layer, labels=labels[:, pos], cp_group=group, packed_seq_params=params, context=context))
        out["loss"].backward()
        return out["loss"].detach(), out["logprobs"], h.grad, layer.weight.grad.clone()

    run(per_token[:, pos])  # warm
    want, got = run(per_token[:, pos]), run(per_seq)
    return all(torch.equal(a, b) for a, b in zip(got, want)) and bool(want[3].abs().sum() > 0)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_per_sequence_advantages_under_context_parallel_2(packed):
    assert run_on_ranks(_cp_case, 2, packed, "seq-mean-token-mean", tp=1, cp=2) == [True, True]


def _keywords(context, packed_seq_params=None, b=2, s=6):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the same layer every call
    layer = torch.nn.Linear(8, 20, bias=False)
    labels = torch.randint(0, 20, (b, s), generator=g)
    return hook_keywords(torch.randn(s, b, 8, generator=g), layer, labels=labels, context=context,
                         packed_seq_params=packed_seq_params)


def test_per_token_inputs_refuse_one_per_sequence():
    """old_logprobs / ref_logprobs are per token: [b] is refused, saying which inputs may be
    one per sequence; [b] advantages of the wrong length name the count expected."""
    with pytest.raises(ValueError, match=r"output_processor_context\['old_logprobs'\]: expected a \[b, s\] = "
                       r"\(2, 6\) tensor \(one per token; one per sequence, \[2\], for 'advantages'\), got \(2,\)"):
        PolicyLossProcessor()(**_keywords({"old_logprobs": torch.zeros(2), "advantages": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"output_processor_context\['advantages'\]: a 1-D tensor is one value "
                       r"per sample \(2\), got 3"):
        PolicyLossProcessor()(**_keywords({"old_logprobs": torch.zeros(2, 6), "advantages": torch.zeros(3)}))


def test_a_packed_batch_takes_one_per_packed_sequence():
    """A packed batch is one row: a 1-D tensor is one per packed sequence (cu_seqlens_q), and
    one per row ([1]) of a batch of 3 packed sequences is refused, saying so."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 2, 5, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3)
    old = torch.full((1, 8), -3.0)
    with pytest.raises(ValueError, match=r"one value per packed sequence \(3, from packed_seq_params.cu_seqlens_q; "
                       r"a packed batch is one row, \[1, total_tokens\]\), got 1"):
        PolicyLossProcessor()(**_keywords({"old_logprobs": old, "advantages": torch.ones(1)}, params, b=1, s=8))
    adv = torch.tensor([1.0, -2.0, 0.5])
    per_token = adv.repeat_interleave(cu.diff().long()).unsqueeze(0)
    a = PolicyLossProcessor()(**_keywords({"old_logprobs": old, "advantages": adv}, params, b=1, s=8))
    b = PolicyLossProcessor()(**_keywords({"old_logprobs": old, "advantages": per_token}, params, b=1, s=8))
    assert torch.equal(a["loss"], b["loss"])


def test_a_loss_of_your_own_names_its_per_sequence_inputs():
    """A plain per-token function takes [b] advantages as PolicyLoss does, and other inputs one
    per sequence where its ``sequence_inputs`` names them."""
    def weighted(logprob, entropy, *, advantages, seq_weight):
        return -advantages * seq_weight * logprob

    w, adv = torch.tensor([0.5, 2.0]), torch.tensor([1.0, -1.0])
    expand = lambda t: t[:, None].expand(2, 6).clone()  # noqa: E731
    processor = PolicyLossProcessor(loss=per_token_loss(weighted, needs_entropy=False))
    with pytest.raises(ValueError, match=r"\['seq_weight'\]: expected a \[b, s\]"):
        processor(**_keywords({"advantages": adv, "seq_weight": w}))
    weighted.sequence_inputs = ("advantages", "seq_weight")
    processor = PolicyLossProcessor(loss=per_token_loss(weighted, needs_entropy=False))
    a = processor(**_keywords({"advantages": adv, "seq_weight": w}))
    b = processor(**_keywords({"advantages": expand(adv), "seq_weight": expand(w)}))
    assert torch.equal(a["loss"], b["loss"]) and a["loss"] != 0


def test_a_loss_without_advantages_takes_nothing_one_per_sequence():
    """The default per-sequence input, advantages, is offered only to a loss that takes it: a
    loss of other inputs is told its inputs are per token, without naming advantages."""
    def plain(logprob, entropy, *, old_logprobs):
        return (logprob - old_logprobs) ** 2

    processor = PolicyLossProcessor(loss=per_token_loss(plain, needs_entropy=False))
    assert processor.sequence_inputs() == ()
    with pytest.raises(ValueError, match=r"\['old_logprobs'\]: expected a \[b, s\] = \(2, 6\) tensor "
                       r"\(one per token\), got \(2,\)"):
        processor(**_keywords({"old_logprobs": torch.zeros(2)}))
