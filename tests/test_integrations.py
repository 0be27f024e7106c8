"""The verl and NeMo RL processors against the formulas those frameworks document and against the
stock path (values and gradients), TP 1 and 2, sequence parallel on and off, packed batches; and
their modules import without verl or NeMo RL installed."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from mcore_hooks import enable_output_processor
from mcore_hooks.integrations.nemo_rl import NemoRLLogprobProcessor
from mcore_hooks.integrations.verl import (
    FusedOutputProcessorContext,
    VerlFusedOutput,
    VerlFusedProcessor,
)
from mcore_hooks.testing import TinyModelConfig, build_tiny_model, hook_keywords, run_on_ranks, tiny_batch

pytestmark = pytest.mark.usefixtures("mp1")
T = 0.7


def test_modules_import_without_the_frameworks():
    code = (
        "import sys; import mcore_hooks.integrations.verl, mcore_hooks.integrations.nemo_rl; "
        "assert not any(m.split('.')[0] in ('verl', 'nemo_rl') for m in sys.modules), "
        "[m for m in sys.modules if m.split('.')[0] in ('verl', 'nemo_rl')]"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def _stock_logits(model, batch) -> torch.Tensor:
    """The stock model's logits ``[b, s, V]`` (gathered over TP), float32."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    return model(**inputs, runtime_gather_output=True).float()


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_grads(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for n in a:
        rel = ((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-30)).item()
        assert rel < tol, (n, rel)


# --------------------------------------------------------------------------- verl


def _verl_case(packed: bool, tied: bool, sp: bool = False, per_sample: bool = False):
    """verl's contract on a packed (or plain) batch, against the formula
    log_probs = log_softmax(logits / T)[label], entropy = -sum p log p, over the flattened tokens,
    computed from the stock logits; gradients of every parameter from the same objective."""
    cfg = TinyModelConfig(tied=tied, sequence_parallel=sp)
    stock = build_tiny_model(cfg)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg, packed=packed, batch_size=3)
    labels = batch["labels"]
    if per_sample:
        temperature = torch.tensor([0.5, 0.9, 1.3])
        per_token = torch.tensor([0.5, 0.9, 1.3]).repeat_interleave(
            batch["packed_seq_params"].cu_seqlens_q.diff().long()
        ) if packed else torch.tensor([0.5, 0.9, 1.3])[:, None]
    else:
        temperature, per_token = T, T
    seen = {}

    class Capture(VerlFusedProcessor):
        def process(self, ctx):
            seen["hidden"] = ctx.hidden_states
            return super().process(ctx)

    g = torch.Generator().manual_seed(1)
    out = model(**batch, output_processor=Capture(),
                output_processor_context=FusedOutputProcessorContext(temperature=temperature))
    assert isinstance(out, VerlFusedOutput) and out.hidden_states is seen["hidden"]
    assert out.log_probs.dtype == out.entropy.dtype == torch.float32
    assert out.log_probs.shape == out.entropy.shape == (labels.numel(),)
    w1, w2 = torch.rand(labels.numel(), generator=g), torch.rand(labels.numel(), generator=g)
    (out.log_probs * w1 + out.entropy * w2).sum().backward()

    logits = _stock_logits(stock, batch)  # [b, s, V]
    scale = per_token.view(1, -1, 1) if packed and per_sample else per_token
    logp = torch.log_softmax(logits / (scale.unsqueeze(-1) if per_sample and not packed else scale), -1)
    ref_lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1).reshape(-1)
    ref_ent = -(logp.exp() * logp).sum(-1).reshape(-1)
    (ref_lp * w1 + ref_ent * w2).sum().backward()
    return (out.log_probs.detach(), ref_lp.detach(), out.entropy.detach(), ref_ent.detach(),
            _grads(model), _grads(stock))


@pytest.mark.parametrize("per_sample", [False, True], ids=["float", "per-sample"])
@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_verl_processor_is_verls_formula_and_stock(tied, packed, per_sample):
    lp, ref_lp, ent, ref_ent, grads, ref_grads = _verl_case(packed, tied, per_sample=per_sample)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    _close_grads(grads, ref_grads)


def _tp2_case(framework: str, sp: bool):
    if framework == "verl":
        lp, ref_lp, ent, ref_ent, grads, ref_grads = _verl_case(True, False, sp=sp)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    else:
        lp, ref_lp, grads, ref_grads = _nemo_case(True, False, sp=sp)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    _close_grads(grads, ref_grads)
    return True


@pytest.mark.parametrize("framework", ["verl", "nemo_rl"])
def test_tensor_parallel_2_with_and_without_sequence_parallel(framework):
    for sp in (False, True):
        assert run_on_ranks(_tp2_case, 2, framework, sp) == [True, True]


def test_verl_options_and_context_errors():
    cfg = TinyModelConfig()
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg)
    no_entropy = model(**batch, output_processor=VerlFusedProcessor(calculate_entropy=False))
    assert no_entropy.entropy is None and no_entropy.log_probs.shape == (batch["labels"].numel(),)
    pair = model(**batch, output_processor=VerlFusedProcessor(as_tuple=True))
    assert isinstance(pair, tuple) and len(pair) == 2
    torch.testing.assert_close(pair[0], no_entropy.log_probs)  # no context: temperature 1
    single = model(**batch, output_processor=VerlFusedProcessor(as_tuple=True, calculate_entropy=False))
    assert isinstance(single, tuple) and len(single) == 1
    for bad in (0.0, -1.0, float("nan"), "hot"):
        with pytest.raises(ValueError, match="output_processor_context.temperature"):
            model(**batch, output_processor=VerlFusedProcessor(),
                  output_processor_context=FusedOutputProcessorContext(temperature=bad))
    with pytest.raises(TypeError, match="output_processor_context: expected an object with a `temperature`"):
        model(**batch, output_processor=VerlFusedProcessor(), output_processor_context=object())
    with pytest.raises(TypeError, match="calculate_entropy"):
        VerlFusedProcessor(calculate_entropy="yes")
    # any object with a temperature will do
    duck = model(**batch, output_processor=VerlFusedProcessor(),
                 output_processor_context=types.SimpleNamespace(temperature=T))
    ref = model(**batch, output_processor=VerlFusedProcessor(),
                output_processor_context=FusedOutputProcessorContext(temperature=T))
    torch.testing.assert_close(duck.log_probs, ref.log_probs, rtol=0, atol=0)


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
def test_verl_per_token_temperature_is_the_per_sample_one_laid_out_by_the_caller(packed):
    """A ``[b, s]`` temperature (one per token, as verl packs and shards its per-sample ones like
    the labels, whatever the CP layout) gives the bits of the ``[b]`` one it spreads; another
    shape is refused, naming the labels' shape."""
    cfg = TinyModelConfig()
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg, packed=packed, batch_size=3)
    b, s = batch["labels"].shape
    per_sample = torch.tensor([0.5, 0.9, 1.3])
    if packed:
        per_token = per_sample.repeat_interleave(batch["packed_seq_params"].cu_seqlens_q.diff().long()).view(1, -1)
    else:
        per_token = per_sample[:, None].expand(b, s)
    assert per_token.shape == (b, s)
    run = lambda t: model(**batch, output_processor=VerlFusedProcessor(),
                          output_processor_context=FusedOutputProcessorContext(temperature=t))
    a, c = run(per_sample), run(per_token)
    torch.testing.assert_close(c.log_probs, a.log_probs, rtol=0, atol=0)
    torch.testing.assert_close(c.entropy, a.entropy, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"one per token must have the labels' shape \({b}, {s}\)"):
        run(per_token[:, :-1])


def test_verl_per_token_temperatures_divide_each_tokens_logits():
    """Random per-token temperatures ``[b, s]`` (no two alike in a sample) against the stock
    logits divided token by token: log-probs, entropies and every gradient."""
    cfg = TinyModelConfig()
    stock = build_tiny_model(cfg)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg, batch_size=3)
    labels = batch["labels"]
    g = torch.Generator().manual_seed(4)
    per_token = 0.5 + torch.rand(labels.shape, generator=g)
    out = model(**batch, output_processor=VerlFusedProcessor(),
                output_processor_context=FusedOutputProcessorContext(temperature=per_token))
    w1, w2 = torch.rand(labels.numel(), generator=g), torch.rand(labels.numel(), generator=g)
    (out.log_probs * w1 + out.entropy * w2).sum().backward()
    logp = torch.log_softmax(_stock_logits(stock, batch) / per_token.unsqueeze(-1), -1)
    ref_lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1).reshape(-1)
    ref_ent = -(logp.exp() * logp).sum(-1).reshape(-1)
    (ref_lp * w1 + ref_ent * w2).sum().backward()
    torch.testing.assert_close(out.log_probs, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    _close_grads(_grads(model), _grads(stock))


def test_verl_processor_with_mtp_uses_the_fused_mtp_loss():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    cfg = TinyModelConfig(mtp_num_layers=2, tied=False)
    stock = build_tiny_model(cfg)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg)
    tracked = []
    for m, kwargs in ((stock, {}), (model, dict(output_processor=VerlFusedProcessor()))):
        MTPLossLoggingHelper.tracker.clear()
        m.train()
        m(**batch, **kwargs)
        tracked.append({k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)})
    MTPLossLoggingHelper.tracker.clear()
    assert tracked[0].keys() == tracked[1].keys() and tracked[0]
    for k in tracked[0]:
        torch.testing.assert_close(tracked[1][k], tracked[0][k], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- NeMo RL


def _nemo_case(packed: bool, tied: bool, sp: bool = False):
    """NeMo RL's contract: labels=input_ids, float32 [B, S-1] log-probs of input_ids[:, 1:] from
    the logits divided by T once; against the stock logits (per packed sequence)."""
    cfg = TinyModelConfig(tied=tied, sequence_parallel=sp)
    stock = build_tiny_model(cfg)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = {k: v for k, v in tiny_batch(cfg, packed=packed, batch_size=3).items() if k not in ("labels", "loss_mask")}
    ids = batch["input_ids"]
    out = model(**batch, labels=ids, output_processor=NemoRLLogprobProcessor(temperature=T))
    assert out.dtype == torch.float32 and out.shape == (ids.shape[0], ids.shape[1] - 1)
    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()

    logp = torch.log_softmax(_stock_logits(stock, batch) / T, -1)[:, :-1]
    ref = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, S-1]
    if packed:  # no label crosses a sequence boundary: each sequence's last position gives 0
        ends = batch["packed_seq_params"].cu_seqlens_q[1:-1].long() - 1
        ref[:, ends] = 0.0
    (ref * w).sum().backward()
    return out.detach(), ref.detach(), _grads(model), _grads(stock)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_nemo_rl_processor_is_the_stock_next_token_logprobs(tied, packed):
    out, ref, grads, ref_grads = _nemo_case(packed, tied)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    _close_grads(grads, ref_grads)


def test_nemo_rl_temperature_divides_the_logits_once():
    """NeMo RL's loop divides its fused log-probs by T; ours are log_softmax(z / T), not that."""
    cfg = TinyModelConfig(tied=False)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = {k: v for k, v in tiny_batch(cfg).items() if k not in ("labels", "loss_mask")}
    ids = batch["input_ids"]
    with torch.no_grad():
        ours = model(**batch, labels=ids, output_processor=NemoRLLogprobProcessor(temperature=T))
        at_one = model(**batch, labels=ids, output_processor=NemoRLLogprobProcessor())
        logits = _stock_logits(model, batch)
    right = torch.log_softmax(logits / T, -1)[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, right, rtol=1e-5, atol=1e-5)
    # what dividing the log-probs gives, NeMo RL's fused path: far from it (docs/migration.md:
    # about 0.3 relative to it at T = 0.7, norm-wise over the batch)
    fused = at_one / T
    assert 0.25 < ((ours - fused).norm() / fused.norm()).item() < 0.35


def _nemo_cp():
    """CP=2 with NeMo RL's load-balanced input sharding: every rank gets the whole [B, S-1]
    equal to the unsplit run; the hidden-state gradient is NeMo RL's (all-reduced over CP, so
    cp x the unsplit gradient of this rank's chunks)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    g = torch.Generator().manual_seed(4)
    s, b, h, vocab = 8, 2, 16, 40
    torch.manual_seed(0)
    layer = torch.nn.Linear(h, vocab, bias=False)
    hidden = torch.randn(s, b, h, generator=g)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    w = torch.rand(b, s - 1, generator=g)

    def run(hid, idx, cp_group):
        hid = hid.clone().requires_grad_()
        out = NemoRLLogprobProcessor(temperature=T)(
            **hook_keywords(hid, layer, labels=idx, input_ids=idx, cp_group=cp_group)
        )
        (out * w).sum().backward()
        return out.detach(), hid.grad

    chunks = [slice(i * s // 4, (i + 1) * s // 4) for i in range(4)]
    mine = [chunks[rank], chunks[3 - rank]]
    local_h = torch.cat([hidden[c] for c in mine])
    local_ids = torch.cat([ids[:, c] for c in mine], dim=1)
    out, dh = run(local_h, local_ids, group)
    full, dh_full = run(hidden, ids, None)
    return out, full, dh, torch.cat([dh_full[c] for c in mine]) * 2


def test_nemo_rl_processor_context_parallel_2():
    for out, full, dh, ref in run_on_ranks(_nemo_cp, 2, tp=1, cp=2):
        torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dh, ref, rtol=1e-5, atol=1e-7)


def test_nemo_rl_processor_refuses_mtp_with_unshifted_labels():
    """NeMo RL's labels=input_ids are unshifted; Megatron's MTP rolls labels as shifted ones, so
    the depths would learn the token they are fed: refused at the first depth, no gradient."""
    cfg = TinyModelConfig(mtp_num_layers=1, tied=False)
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg)
    ids = batch.pop("input_ids")
    batch.pop("labels", None)
    from mcore_hooks import compat

    # the way out it names exists on this release: labels=None where Megatron derives the depths'
    # targets (0.19+), none before (0.16's MTP needs labels: labels=None failed inside Megatron)
    way = "Call the model with labels=None" if compat.mtp_derives_labels() else "there is no way .* 0.19"
    with pytest.raises(ValueError, match="NemoRLLogprobProcessor with multi-token prediction: called with labels"
                       f"(.|\\n)*{way}"):
        model(input_ids=ids, labels=ids, **batch, output_processor=NemoRLLogprobProcessor())
    assert all(p.grad is None for p in model.parameters())


def _derives_mtp_labels() -> bool:
    from mcore_hooks import compat

    return compat.mtp_derives_labels()


@pytest.mark.skipif(not _derives_mtp_labels(), reason="Megatron Core < 0.19 cannot derive MTP labels from input_ids")
def test_nemo_rl_processor_with_mtp_as_nemo_rl_runs_it():
    """NeMo RL's own non-fused call with MTP: labels=None, loss_mask = token mask (unshifted);
    Megatron derives the depths' targets from input_ids. The processor's fused MTP loss equals
    stock MTP there (the tracker and every MTP-block gradient), its log-probs stock's."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    cfg = TinyModelConfig(mtp_num_layers=2, tied=False)
    stock = build_tiny_model(cfg)
    model = enable_output_processor(build_tiny_model(cfg))
    model.load_state_dict(stock.state_dict())
    batch = tiny_batch(cfg)
    ids = batch.pop("input_ids")
    batch.pop("labels", None)
    batch.pop("loss_mask", None)
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(ids.shape, generator=g) > 0.2).float()
    w = torch.rand(ids.shape[0], ids.shape[1] - 1, generator=g)
    results = []
    for m, fused in ((stock, False), (model, True)):
        MTPLossLoggingHelper.tracker.clear()
        m.train()
        if fused:
            lp = m(input_ids=ids, labels=None, loss_mask=mask, **batch,
                   output_processor=NemoRLLogprobProcessor(temperature=T))
        else:
            logits = m(input_ids=ids, labels=None, loss_mask=mask, **batch)
            logp = torch.log_softmax(logits.float() / T, dim=-1)
            lp = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        (lp * w).sum().backward()
        tracked = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((lp.detach(), tracked, grads))
    MTPLossLoggingHelper.tracker.clear()
    (lp_s, tr_s, g_s), (lp_f, tr_f, g_f) = results
    torch.testing.assert_close(lp_f, lp_s, rtol=1e-5, atol=1e-5)
    assert tr_s.keys() == tr_f.keys() and tr_s
    for k in tr_s:
        torch.testing.assert_close(tr_f[k], tr_s[k], rtol=1e-5, atol=1e-5)
    mtp_params = [n for n in g_s if n.startswith("mtp.")]
    assert mtp_params and g_s.keys() == g_f.keys()
    _close_grads(g_f, g_s)


def test_the_package_exports_both_processors():
    """README: ``from mcore_hooks.integrations import VerlFusedProcessor`` (it raised)."""
    import mcore_hooks.integrations as integrations

    assert integrations.VerlFusedProcessor is VerlFusedProcessor
    assert integrations.NemoRLLogprobProcessor is NemoRLLogprobProcessor


def test_verl_mtp_detach_weight_keeps_the_depths_gradient_off_the_head():
    """verl's own MTP loss detaches the output weight: with ``mtp_detach_weight`` the head's
    gradient is the main loss's alone (as with the depths' loss zeroed), while the MTP block
    still learns; without it the depths' gradient reaches the head (Megatron's semantics)."""
    cfg = TinyModelConfig(mtp_num_layers=1, tied=False)
    batch = tiny_batch(cfg)

    class NoMTPLoss(VerlFusedProcessor):
        def mtp_loss(self, depth):
            r = super().mtp_loss(depth)
            return r._replace(loss=r.loss * 0.0)

    def grads(processor):
        model = enable_output_processor(build_tiny_model(cfg))
        model.train()
        out = model(**batch, output_processor=processor)
        out.log_probs.sum().backward()
        mtp = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is not None]
        return model.output_layer.weight.grad.clone(), mtp

    head_only, _ = grads(NoMTPLoss())
    detached, mtp_detached = grads(VerlFusedProcessor(mtp_detach_weight=True))
    attached, _ = grads(VerlFusedProcessor())
    torch.testing.assert_close(detached, head_only, rtol=1e-6, atol=1e-7)
    assert (attached - head_only).abs().max() > 1e-4
    assert mtp_detached and any(g.abs().sum() > 0 for g in mtp_detached)
