"""Multi-token prediction through the processor: each depth's loss from the processor's
``mtp_loss`` (the fused kernel for the bundled processors), everything else Megatron's.

Against stock MTP on the same weights: the main output, the MTP logging tracker (loss; 0.19:
correct and total), and every parameter's gradient; 1 and 2 depths, tied and untied, packed
sequences, labels given and derived, TP=2 with sequence parallel on and off, ``mtp_detach_heads``
where the release has it (MTP under the schedule plan: tests/test_gpu_schedule_plan.py, which
needs MoE layers). The output layer's own forward never runs for any depth (nor the main
head's), and no ``[tokens, vocab]`` tensor is made.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mcore_hooks import DefaultProcessor, LinearCEProcessor, LogprobEntropyProcessor, enable_output_processor
from mcore_hooks.testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    run_on_ranks,
    supports_packed_sequences,
    tiny_batch,
)

pytestmark = pytest.mark.usefixtures("mp1")


def _tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return MTPLossLoggingHelper.tracker


def _tracked() -> dict:
    """The tracker's per-depth values (loss; 0.19: correct, total), then emptied."""
    tracker = _tracker()
    values = {k: v.clone() for k, v in tracker.items() if torch.is_tensor(v)}
    tracker.clear()
    return values


def _has_detach_heads() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "mtp_detach_heads" in TransformerConfig.__dataclass_fields__


def _derives_labels() -> bool:
    """0.19: without labels, the MTP loss rolls input_ids; 0.17/0.18 skip it; older crash."""
    import inspect

    from megatron.core.transformer import multi_token_prediction as m

    fn = getattr(m, "process_mtp_loss", None)
    return fn is not None and "input_ids" in inspect.signature(fn).parameters


def _accepting_labels(model, batch: dict) -> dict:
    """Labels for which some MTP predictions are right (so acceptance counts are not all 0):
    depth 1 at position t predicts label t+1; set half of those to the stock argmax."""
    seen = []
    handle = model.output_layer.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    with torch.no_grad():
        model(**batch, runtime_gather_output=True)  # the whole vocabulary on every TP rank
    handle.remove()
    depth1 = seen[0].argmax(-1).t()  # [b, s]: the first output-layer call is MTP depth 1
    labels = batch["labels"].clone()
    labels[:, 1::2] = depth1[:, :-1:2]
    return dict(batch, labels=labels)


def _run(model, batch: dict, processor=None) -> tuple[torch.Tensor, dict, dict]:
    """Main output (per-token loss), tracker values, every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    _tracker().clear()
    model.train()
    out = model(**batch) if processor is None else model(**batch, output_processor=processor)
    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(5))
    (out.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), _tracked(), grads


def _compare(ours, stock, tol=1e-5):
    (out_a, tr_a, g_a), (out_b, tr_b, g_b) = ours, stock
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    assert tr_a.keys() == tr_b.keys() and tr_a, (tr_a, tr_b)
    for k in tr_a:
        torch.testing.assert_close(tr_a[k], tr_b[k], rtol=tol, atol=tol)
    assert g_a.keys() == g_b.keys() and g_a
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_b[n], rtol=tol, atol=tol, msg=n)


def _pair(cfg):
    stock = build_tiny_model(cfg)
    ours = enable_output_processor(build_tiny_model(cfg))
    return stock, ours


def _mtp_pair(cfg):
    if cfg.model_class not in available_model_classes():
        pytest.skip(f"no {cfg.model_class} model class on this release")
    try:
        return _pair(cfg)
    except NotImplementedError as e:  # Hybrid/Mamba MTP: 0.18+
        pytest.skip(str(e))


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("depths", [1, 2])
def test_fused_mtp_equals_stock_mtp(depths, tied, packed):
    if packed and not supports_packed_sequences("gpt"):
        pytest.skip("no packed sequences on this release")
    cfg = TinyModelConfig(mtp_num_layers=depths, tied=tied)
    stock, ours = _pair(cfg)
    batch = tiny_batch(cfg, packed=packed)
    try:
        batch = _accepting_labels(stock, batch)
    except AssertionError as e:  # stock MTP refuses packed sequences before 0.16
        pytest.skip(f"stock MTP on this release: {e}")
    ref = _run(stock, batch)
    got = _run(ours, batch, LinearCEProcessor())
    _compare(got, ref)
    if "correct_values" in got[1]:  # 0.19 logs acceptance: some predictions were right
        assert got[1]["correct_values"][0] > 0


@pytest.mark.parametrize("model_class", ["hybrid", "mamba"])
def test_fused_mtp_on_hybrid_and_mamba_models(model_class):
    """HybridModel / MambaModel (0.18+: MTP from the layer pattern's MTP part) through the same
    MTP loss, backported hook and all."""
    cfg = TinyModelConfig(model_class=model_class, mtp_num_layers=2, tied=False)
    stock, ours = _mtp_pair(cfg)
    batch = _accepting_labels(stock, tiny_batch(cfg))
    _compare(_run(ours, batch, LinearCEProcessor()), _run(stock, batch))


def test_custom_processor_without_mtp_loss_keeps_stock_mtp():
    cfg = TinyModelConfig(mtp_num_layers=2)
    stock, ours = _pair(cfg)
    batch = tiny_batch(cfg)
    assert not hasattr(DefaultProcessor(), "mtp_loss")
    _compare(_run(ours, batch, DefaultProcessor()), _run(stock, batch), tol=0)


def test_labels_derived_from_input_ids():
    cfg = TinyModelConfig(mtp_num_layers=2, tied=False)
    stock, ours = _pair(cfg)
    batch = {k: v for k, v in tiny_batch(cfg).items() if k not in ("labels", "loss_mask")}
    if not _derives_labels():
        pytest.skip("this release computes no MTP loss without labels")
    model_out = {}
    for name, model, processor in (("stock", stock, None), ("ours", ours, LogprobEntropyProcessor(as_tuple=True))):
        model.zero_grad(set_to_none=True)
        _tracker().clear()
        out = model(**batch) if processor is None else model(**batch, output_processor=processor)
        out = out[0] if isinstance(out, tuple) else out  # the logits (stock) or log-probs (ours)
        out.float().sum().backward()  # the MTP losses' gradients ride on the main output's
        model_out[name] = (_tracked(), {n: p.grad.clone() for n, p in model.named_parameters() if "mtp" in n})
    (tr_a, g_a), (tr_b, g_b) = model_out["ours"], model_out["stock"]
    assert tr_a.keys() == tr_b.keys() and tr_a
    for k in tr_a:
        torch.testing.assert_close(tr_a[k], tr_b[k], rtol=1e-5, atol=1e-5)
    for n in g_a:  # MTP layers get gradients only from the MTP losses
        torch.testing.assert_close(g_a[n], g_b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_mtp_detach_heads():
    if not _has_detach_heads():
        pytest.skip("mtp_detach_heads arrived in Megatron Core 0.19")
    cfg = TinyModelConfig(mtp_num_layers=2, tied=False, mtp_detach_heads=True)
    stock, ours = _pair(cfg)
    batch = tiny_batch(cfg)
    _compare(_run(ours, batch, LinearCEProcessor()), _run(stock, batch))


class ShapesMade(TorchDispatchMode):
    """Shapes of the tensors every operator allocates (views excluded: they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or in-place
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_depth_calls_the_output_layer_or_builds_logits(monkeypatch):
    # a vocabulary no other dimension of the tiny model has (3 x hidden is the QKV width)
    cfg = TinyModelConfig(mtp_num_layers=2, tied=False, vocab_size=160)
    stock, ours = _pair(cfg)
    batch = tiny_batch(cfg, batch_size=3)
    tokens, vocab = batch["input_ids"].numel(), cfg.vocab_size
    stock_forward = type(ours.output_layer).forward
    ran = []

    def counting(self, *args, **kwargs):
        if self is ours.output_layer or self is stock.output_layer:
            ran.append(self is ours.output_layer)
        return stock_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(ours.output_layer), "forward", counting)

    def logits_like(shapes):  # a [.., vocab] tensor holding a quarter of [tokens, vocab] or more
        return [s for s in shapes if s and s[-1] == vocab and torch.Size(s).numel() >= tokens * vocab // 4]

    with ShapesMade() as made:
        ours.train()
        ours(**batch, output_processor=LogprobEntropyProcessor(chunk_size=4))["logprobs"].sum().backward()
    assert ran == [] and logits_like(made.shapes) == []
    with ShapesMade() as made_stock:
        stock(**batch).sum().backward()
    assert ran == [False] * 3 and logits_like(made_stock.shapes)  # the check can see them


# --------------------------------------------------------------------------- tensor parallel


def _tp2_mtp(sp: bool):
    cfg = TinyModelConfig(mtp_num_layers=2, tied=False, sequence_parallel=sp)
    stock, ours = _pair(cfg)
    batch = _accepting_labels(stock, tiny_batch(cfg))
    ref = _run(stock, batch)
    got = _run(ours, batch, LinearCEProcessor())
    _compare(got, ref)
    return {k: v.tolist() for k, v in got[1].items()}


def test_tensor_parallel_2_with_and_without_sequence_parallel():
    for sp in (False, True):
        trackers = run_on_ranks(_tp2_mtp, 2, sp)
        assert trackers[0] == trackers[1]  # every TP rank logs the same
