"""The hook itself: bit-identity with stock, the keywords delivered, stages, wrappers, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mcore_hooks
from mcore_hooks import (
    OUTPUT_PROCESSOR_KEYWORDS,
    DefaultProcessor,
    PostprocessContext,
    PostprocessProcessor,
    check_output_processor,
    enable_output_processor,
    hooked_class,
    supports_output_processor,
)
from mcore_hooks import compat, hooked
from mcore_hooks.testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    run_on_ranks,
    stock_model_class,
    tiny_batch,
)

CLASSES = available_model_classes()
pytestmark = pytest.mark.usefixtures("mp1")


def _pair(cfg: TinyModelConfig):
    stock = build_tiny_model(cfg)
    hooked = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))
    return stock, hooked


def _packed_ok(model_class: str) -> bool:
    return compat.forward_accepts(stock_model_class(model_class), "packed_seq_params")


def _out_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def _layouts(model_class):
    yield False
    if _packed_ok(model_class):
        yield True


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_class", CLASSES)
def test_hook_off_is_bitwise_stock(model_class, tied):
    cfg = TinyModelConfig(model_class=model_class, tied=tied)
    stock, hooked = _pair(cfg)
    assert hooked.state_dict().keys() == stock.state_dict().keys()
    for packed in _layouts(model_class):
        batch = tiny_batch(cfg, packed=packed)
        _assert_bitwise(_out_and_grads(stock, **batch), _out_and_grads(hooked, **batch, output_processor=None))
        # and through enable_output_processor on an existing stock instance
        other = enable_output_processor(build_tiny_model(cfg))
        _assert_bitwise(_out_and_grads(stock, **batch), _out_and_grads(other, **batch))


@pytest.mark.parametrize("with_labels", [True, False], ids=["loss", "logits"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_class", CLASSES)
def test_default_processor_is_bitwise_stock(model_class, tied, with_labels):
    cfg = TinyModelConfig(model_class=model_class, tied=tied)
    stock, hooked = _pair(cfg)
    for packed in _layouts(model_class):
        batch = tiny_batch(cfg, packed=packed, with_labels=with_labels)
        ref = _out_and_grads(stock, **batch)
        got = _out_and_grads(hooked, **batch, output_processor=DefaultProcessor())
        _assert_bitwise(ref, got)
        if with_labels:
            assert got[0].dtype == torch.float32 and got[0].shape == batch["labels"].shape
        else:
            assert got[0].shape[-1] == cfg.vocab_size


class Recorder:
    """A plain function-style processor: records what it got, returns the stock result."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return PostprocessContext.from_kwargs(kwargs).default()


@pytest.mark.parametrize("model_class", CLASSES)
def test_processor_receives_upstream_keywords(model_class):
    cfg = TinyModelConfig(model_class=model_class, tied=True)
    _, model = _pair(cfg)
    batch = tiny_batch(cfg)
    rec, marker = Recorder(), object()
    model(**batch, output_processor=rec, output_processor_context=marker)
    assert len(rec.calls) == 1
    kw = rec.calls[0]
    assert tuple(kw) == OUTPUT_PROCESSOR_KEYWORDS
    assert kw["context"] is marker
    assert kw["output_layer"] is model.output_layer
    assert kw["output_weight"] is model.shared_embedding_or_output_weight()
    assert kw["config"] is model.config
    for name in ("labels", "input_ids", "position_ids", "attention_mask"):
        assert kw[name] is batch[name], name
    assert kw["loss_mask"] is batch.get("loss_mask")
    assert kw["packed_seq_params"] is None and kw["inference_context"] is None
    assert kw["runtime_gather_output"] is None
    # decoder_input is the model's own preprocessed decoder input: the embedding output
    emb = model.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert torch.equal(kw["decoder_input"], emb)
    s, b = batch["input_ids"].shape[1], batch["input_ids"].shape[0]
    assert kw["hidden_states"].shape == (s, b, cfg.hidden_size)
    assert kw["compute_language_model_loss"].__self__ is model
    x = torch.randn(3, 4)
    assert torch.equal(kw["scale_logits"](x), model._scale_logits(x) if hasattr(model, "_scale_logits") else x)

    untied = build_tiny_model(dataclasses.replace(cfg, tied=False), model_cls=type(model))
    rec2 = Recorder()
    untied(**batch, output_processor=rec2)
    assert rec2.calls[0]["output_weight"] is None


def test_backport_and_native_deliver_the_same_keywords():
    """Where a class has upstream's hook, the backport must hand the processor the same values."""
    native = [c for c in CLASSES if compat.has_native_hook(stock_model_class(c))]
    if not native:
        pytest.skip("this Megatron Core release has no native output_processor hook to compare with")
    for model_class in native:
        for tied in (True, False):
            cfg = TinyModelConfig(model_class=model_class, tied=tied)
            stock = build_tiny_model(cfg)
            backport = build_tiny_model(cfg, model_cls=hooked.backport_class(stock_model_class(model_class)))
            for packed in _layouts(model_class):
                batch = tiny_batch(cfg, packed=packed)
                a, b = Recorder(), Recorder()
                ctx = {"any": "object"}
                out_a = stock(**batch, output_processor=a, output_processor_context=ctx)
                out_b = backport(**batch, output_processor=b, output_processor_context=ctx)
                assert torch.equal(out_a, out_b)
                ka, kb = a.calls[0], b.calls[0]
                assert tuple(ka) == tuple(kb) == OUTPUT_PROCESSOR_KEYWORDS
                for k in OUTPUT_PROCESSOR_KEYWORDS:
                    va, vb = ka[k], kb[k]
                    if torch.is_tensor(va):
                        assert torch.is_tensor(vb) and torch.equal(va, vb), k
                    elif k == "output_layer":
                        assert type(va) is type(vb), k
                    elif k in ("compute_language_model_loss", "scale_logits"):
                        assert va.__func__ is vb.__func__, k
                    elif k == "config":
                        assert va is stock.config and vb is backport.config
                    else:
                        assert va is vb, k


@pytest.mark.parametrize("model_class", CLASSES)
def test_non_last_stage_returns_hidden_states_and_never_calls_processor(model_class):
    cfg = TinyModelConfig(model_class=model_class, post_process=False)
    stock, hooked = _pair(cfg)
    batch = tiny_batch(cfg, with_labels=False)
    rec = Recorder()
    out = hooked(**batch, output_processor=rec)
    assert rec.calls == []
    assert torch.equal(out, stock(**batch))
    s, b = batch["input_ids"].shape[1], batch["input_ids"].shape[0]
    assert out.shape == (s, b, cfg.hidden_size)


class TokenLogprob(PostprocessProcessor):
    """A subclass as a framework would write one: per-token log-probs of the labels, [b, s]."""

    def process(self, ctx):
        logits = ctx.logits().float()  # [s, b, v] (TP=1 here)
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, ctx.labels.t().unsqueeze(-1)).squeeze(-1).t()


@pytest.mark.parametrize("model_class", CLASSES)
def test_subclassed_processor_matches_stock_loss(model_class):
    cfg = TinyModelConfig(model_class=model_class)
    stock, hooked = _pair(cfg)
    batch = tiny_batch(cfg)
    loss = stock(**batch)
    logp = hooked(**batch, output_processor=TokenLogprob())
    torch.testing.assert_close(logp, -loss, rtol=1e-5, atol=1e-6)


def test_context_derived_facts():
    cfg = TinyModelConfig(tied=False)
    _, model = _pair(cfg)
    seen = {}

    class Grab(PostprocessProcessor):
        def process(self, ctx):
            seen["ctx"] = ctx
            return ctx.default()

    model(**tiny_batch(cfg), output_processor=Grab())
    ctx = seen["ctx"]
    assert ctx.weight is model.output_layer.weight
    assert (ctx.tp_rank, ctx.tp_size, ctx.vocab_start, ctx.vocab_end) == (0, 1, 0, cfg.vocab_size)
    assert ctx.sequence_parallel is False and ctx.cp_size == 1 and ctx.extra == {}
    # the CP group is the model's own (its process-group collection, 0.14+), not global state
    assert ctx.cp_group is getattr(model, "cp_group", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.labels = None  # type: ignore[misc]


def test_unknown_keywords_are_kept():
    cfg = TinyModelConfig()
    _, model = _pair(cfg)
    rec = Recorder()
    model(**tiny_batch(cfg), output_processor=rec)
    kwargs = dict(rec.calls[0], future_keyword=42)
    ctx = PostprocessContext.from_kwargs(kwargs)
    assert ctx.extra == {"future_keyword": 42}
    assert DefaultProcessor()(**kwargs).shape == kwargs["labels"].shape


# --------------------------------------------------------------------------- enabling


@pytest.mark.parametrize("model_class", CLASSES)
def test_enable_is_per_instance_idempotent_and_detected(model_class):
    """Without the hook, the instance's class is switched to the hooked one; with upstream's
    hook (0.18+ GPTModel) the model is left as it is: upstream's hook does what it asks for."""
    cls = stock_model_class(model_class)
    cfg = TinyModelConfig(model_class=model_class)
    model, bystander = build_tiny_model(cfg), build_tiny_model(cfg)
    native = compat.has_native_hook(cls)
    assert supports_output_processor(model) is native
    assert enable_output_processor(model) is model
    assert supports_output_processor(model)
    assert type(model) is (cls if native else hooked_class(cls)) and isinstance(model, cls)
    enable_output_processor(model)
    assert type(model) is (cls if native else hooked_class(cls))
    assert type(bystander) is cls  # no global patching
    assert cls.forward is compat.language_model_classes()[cls.__name__].forward
    assert getattr(mcore_hooks, "Hooked" + cls.__name__) is hooked_class(cls)
    # built directly, the hooked class passes a native class's calls through, nothing replaced
    assert issubclass(hooked_class(cls), hooked.NativeHookMixin) is native


@pytest.mark.parametrize("asks", ["mtp", "combined-1F1B"])
def test_a_native_class_is_switched_only_for_what_upstream_lacks(asks):
    """On a class with upstream's hook, ``enable_output_processor`` switches the instance's class
    when the model asks for what upstream lacks: MTP (the depths' loss through the processor) or
    the combined-1F1B schedule (the plan's backward over the outputs the loss used)."""
    cls = stock_model_class("gpt")
    if not compat.has_native_hook(cls):
        pytest.skip("this Megatron Core's GPTModel has no native hook: every instance is switched")
    if asks == "mtp" and compat.native_mtp_loss_fn():
        pytest.skip("this Megatron Core takes the depths' loss itself (upstream/0002): see the next test")
    from megatron.core.transformer.module import Float16Module

    cfg = TinyModelConfig(mtp_num_layers=1 if asks == "mtp" else 0)
    chunks = [build_tiny_model(cfg), build_tiny_model(cfg)]
    # a wrapper (as in test_enable_through_wrappers_and_model_chunks) and a list of chunks
    wrapped = [Float16Module(dataclasses.replace(chunks[0].config, bf16=True), chunks[0]), chunks[1]]
    if asks == "combined-1F1B":  # set after the configs are built: what the schedule reads, not validated here
        wrapped[0].config.overlap_moe_expert_parallel_comm = True  # the wrapper's, which the schedules read
        chunks[1].config.overlap_moe_expert_parallel_comm = True
    assert enable_output_processor(wrapped) is wrapped
    for chunk in chunks:
        assert type(chunk) is hooked_class(cls) and issubclass(type(chunk), hooked.NativeHookMixin)


def test_a_native_class_with_mtp_is_left_alone_where_upstream_takes_the_depths_loss(monkeypatch):
    """Where ``process_mtp_loss`` takes a per-depth loss itself (``upstream/0002``), MTP asks for
    nothing upstream lacks: the model is left as it is."""
    cls = stock_model_class("gpt")
    if not compat.has_native_hook(cls):
        pytest.skip("this Megatron Core's GPTModel has no native hook: every instance is switched")
    monkeypatch.setattr(compat, "native_mtp_loss_fn", lambda: True)
    model = build_tiny_model(TinyModelConfig(mtp_num_layers=1))
    enable_output_processor(model)
    assert type(model) is cls


def test_enable_through_wrappers_and_model_chunks():
    from megatron.core.transformer.module import Float16Module

    cfg = TinyModelConfig()
    stock = build_tiny_model(cfg)
    model = build_tiny_model(cfg)
    wrapped = Float16Module(dataclasses.replace(model.config, bf16=True), model)
    wrapped_ref = Float16Module(dataclasses.replace(stock.config, bf16=True), stock)
    assert enable_output_processor([wrapped])[0] is wrapped
    assert supports_output_processor(wrapped)
    batch = tiny_batch(cfg)
    rec = Recorder()
    out = wrapped(**batch, output_processor=rec)
    assert len(rec.calls) == 1 and rec.calls[0]["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(out, wrapped_ref(**batch))

    ddp = torch.nn.parallel.DistributedDataParallel(build_tiny_model(cfg))
    enable_output_processor(ddp)
    assert supports_output_processor(ddp)
    fp32_ref = build_tiny_model(cfg)  # Float16Module above cast `stock` to bf16 in place
    assert torch.equal(ddp(**batch, output_processor=DefaultProcessor()), fp32_ref(**batch))


def test_subclass_of_a_model_class_is_hooked_too():
    base = stock_model_class("gpt")
    sub = type("MyGPT", (base,), {})
    hooked = hooked_class(sub)
    assert issubclass(hooked, sub)
    cfg = TinyModelConfig()
    model = build_tiny_model(cfg, model_cls=hooked)
    ref = build_tiny_model(cfg)
    batch = tiny_batch(cfg)
    assert torch.equal(model(**batch, output_processor=DefaultProcessor()), ref(**batch))


# --------------------------------------------------------------------------- errors


def test_clear_errors():
    cfg = TinyModelConfig()
    # the hooked class (what enable_output_processor switches to where it switches): backport and
    # native pass-through alike name the keyword (before upstream's own call)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class("gpt")))
    batch = tiny_batch(cfg)
    with pytest.raises(TypeError, match="output_processor: expected a callable"):
        model(**batch, output_processor=42)

    def narrow(hidden_states, labels):
        return hidden_states

    with pytest.raises(TypeError, match="does not accept the keyword.*output_layer"):
        model(**batch, output_processor=narrow)
    with pytest.raises(TypeError, match="output_layer"):
        check_output_processor(narrow)
    with pytest.raises(TypeError, match="requires argument.*temperature"):
        check_output_processor(lambda temperature, **kw: None)
    with pytest.raises(TypeError, match="missing keyword.*output_layer"):
        DefaultProcessor()(hidden_states=torch.zeros(1))
    with pytest.raises(TypeError):
        DefaultProcessor()(torch.zeros(1))  # keyword-only
    with pytest.raises(TypeError, match="model: expected a Megatron Core language model"):
        enable_output_processor(torch.nn.Linear(2, 2))
    assert supports_output_processor(torch.nn.Linear(2, 2)) is False
    with pytest.raises(TypeError, match="cls: expected a subclass"):
        hooked_class(torch.nn.Linear)
    with pytest.raises(TypeError):
        PostprocessProcessor()  # abstract: process() must be implemented
    with pytest.raises(AttributeError, match="no attribute"):
        mcore_hooks.HookedBertThing  # noqa: B018


def test_stock_class_without_hook_rejects_processor_keyword():
    """The hook needs enabling where the release has none: stock refuses the keyword outright."""
    cfg = TinyModelConfig()
    model = build_tiny_model(cfg)
    if compat.has_native_hook(type(model)):
        pytest.skip("native hook: stock GPTModel takes output_processor")
    with pytest.raises(TypeError, match="output_processor"):
        model(**tiny_batch(cfg), output_processor=DefaultProcessor())


def test_full_sequence_logits_flag_is_restored():
    import types

    old = types.SimpleNamespace(materialize_only_last_token_logits=True)
    new = types.SimpleNamespace(config=types.SimpleNamespace(materialize_only_last_token_logits=True))
    for ctx, holder in ((old, old), (new, new.config)):
        with compat.full_sequence_logits(ctx):
            assert holder.materialize_only_last_token_logits is False
        assert holder.materialize_only_last_token_logits is True
    with compat.full_sequence_logits(None):
        pass


# --------------------------------------------------------------------------- tensor parallel


def _tp2_checks():
    from mcore_hooks.verify import run_checks

    rows = run_checks()
    # sequence parallel: the processor sees this rank's [s/tp, b, h] shard
    shapes = []
    for model_class in available_model_classes():
        cfg = TinyModelConfig(model_class=model_class, sequence_parallel=True)
        model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(model_class)))
        batch = tiny_batch(cfg)
        seen = []
        model(**batch, output_processor=lambda **kw: seen.append(kw) or DefaultProcessor()(**kw))
        shapes.append((tuple(seen[0]["hidden_states"].shape), PostprocessContext.from_kwargs(seen[0]).sequence_parallel))
    return rows, shapes


@pytest.mark.slow
def test_tensor_parallel_2_matches_stock_with_and_without_sequence_parallel():
    """verify's checks at TP=2: hook off and DefaultProcessor bitwise, fused processors within
    their fp32 tolerance; under SP the processor sees this rank's [s/tp, b, h] shard."""
    per_rank = run_on_ranks(_tp2_checks, 2)
    for rows, shapes in per_rank:
        failed = [r for r in rows if not r.passed]
        assert not failed, failed
        exact = [r for r in rows if r.tolerance == 0]
        assert exact and all(r.value_abs == 0 and r.grad_abs == 0 for r in exact)
        layouts = {r.layout for r in rows}
        assert any("sp" in l for l in layouts) and any("sp" not in l for l in layouts)
        assert any("packed" in l for l in layouts)
        for shape, sp in shapes:
            assert sp is True and shape[0] == 16 // 2, shape
