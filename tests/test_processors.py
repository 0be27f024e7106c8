"""The bundled processors through real Megatron Core models, against the stock path."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from mcore_hooks import PostprocessContext, compat, enable_output_processor, hooked, hooked_class
from mcore_hooks.processors import (
    EntropyProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
)
from mcore_hooks.processors.labels import labels_from_input_ids
from mcore_hooks.testing import (
    TinyModelConfig,
    hook_keywords,
    available_model_classes,
    build_tiny_model,
    run_on_ranks,
    stock_model_class,
    supports_packed_sequences,
    tiny_batch,
)
from mcore_hooks.verify import PRECISION_CHECKS, PROCESSOR_CHECKS, run_checks

pytestmark = pytest.mark.usefixtures("mp1")


def _hooked(cfg):
    return build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))


class Capture:
    """Records the hook's keywords, then runs the wrapped processor."""

    def __init__(self, inner):
        self.inner, self.kwargs = inner, None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        return self.inner(**kwargs)


def _logits64(kwargs, temperature=1.0):
    """float64 logits ``[b, s, v]`` from the hidden states the hook delivered (TP=1)."""
    ctx = PostprocessContext.from_kwargs(kwargs)
    logits = ctx.hidden_states.double() @ ctx.weight.double().t()  # [s, b, v]
    t = temperature.double()[None, :, None] if torch.is_tensor(temperature) else temperature
    return (logits / t).transpose(0, 1)


@pytest.mark.slow
def test_every_processor_matches_stock_on_every_class_tp1():
    rows = run_checks()
    names = {r.processor for r in rows}
    assert names == {c.name for c in PROCESSOR_CHECKS} | {c.name for c in PRECISION_CHECKS}
    assert {r.model for r in rows} == set(available_model_classes())
    failed = [r for r in rows if not r.passed]
    assert not failed, failed
    for r in rows:
        if r.rule == "vs stock":
            assert max(r.value_rel, r.grad_rel) <= (r.tolerance or 0.0)
        else:  # bf16 against float64
            assert "bf16" in r.layout and r.value_rel <= r.stock_value_rel
            assert r.grad_rel <= max(r.stock_grad_rel, r.tolerance)


class _SlightlyOff(FusedLogprobProcessor):
    """Log-probs off by one part in 10**4: far inside bf16's rounding, far outside fp32's."""

    def process(self, ctx):
        return super().process(ctx) * (1 + 1e-4)


def test_verify_catches_a_slightly_wrong_processor():
    from mcore_hooks.verify import PrecisionCheck

    bad_fp32 = dataclasses.replace(PROCESSOR_CHECKS[3], make=_SlightlyOff)
    bad_bf16 = dataclasses.replace(PRECISION_CHECKS[0], make=_SlightlyOff)
    rows = run_checks([bad_fp32], model_classes=["gpt"], precision_checks=[bad_bf16])
    assert rows and not any(r.passed for r in rows)
    assert {r.rule for r in rows} == {"vs stock", "vs float64"}
    assert isinstance(bad_bf16, PrecisionCheck)


def _off_by(factor, make):
    """``make``'s processor with every output scaled by ``factor``."""
    def processor(**kwargs):
        out = make()(**kwargs)
        return tuple(o * factor for o in out) if isinstance(out, tuple) else out * factor

    return lambda: processor


def test_every_check_catches_its_processor_slightly_wrong():
    """Each check of every processor (the integrations' too) fails a processor off by one part
    in 10**4 (float32 against stock) or 10**3 (bf16 against float64: stock's own values are
    2**-9-rounded logits away): no check passes whatever the processor returns."""
    fp32 = [dataclasses.replace(c, make=_off_by(1 + 1e-4, c.make)) for c in PROCESSOR_CHECKS
            if c.make() is not None]
    bf16 = [dataclasses.replace(c, make=_off_by(1 + 1e-3, c.make)) for c in PRECISION_CHECKS]
    rows = run_checks(fp32, model_classes=["gpt"], precision_checks=bf16)
    assert {r.processor for r in rows} == {c.name for c in fp32 + bf16}
    assert not [r for r in rows if r.passed]


@pytest.mark.parametrize("model_class", available_model_classes())
def test_bf16_processor_at_least_as_accurate_as_stock(model_class):
    cfg = TinyModelConfig(model_class=model_class, params_dtype=torch.bfloat16, tied=False)
    stock, model = build_tiny_model(cfg), _hooked(cfg)
    batch = tiny_batch(cfg)
    cap = Capture(LogprobEntropyProcessor())
    out = model(**batch, output_processor=cap)
    assert out["logprobs"].dtype == torch.float32 and out["entropy"].dtype == torch.float32
    logp64 = torch.log_softmax(_logits64(cap.kwargs), -1)
    lp64 = logp64.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    ent64 = -(logp64.exp() * logp64).sum(-1)
    stock_lp = -stock(**batch).double()
    stock_logits = stock(**{k: v for k, v in batch.items() if k != "labels"}).double()
    stock_logp = torch.log_softmax(stock_logits, -1)
    stock_ent = -(stock_logp.exp() * stock_logp).sum(-1)

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert err(out["logprobs"], lp64) <= err(stock_lp, lp64)
    assert err(out["entropy"], ent64) <= err(stock_ent, ent64)
    assert err(out["logprobs"], lp64) < 1e-5 and err(out["entropy"], ent64) < 1e-5


@pytest.mark.parametrize("per_sample", [False, True], ids=["float", "per-sample"])
def test_temperature_divides_logits_in_forward_and_backward(per_sample):
    cfg = TinyModelConfig(tied=False)
    model = _hooked(cfg)
    batch = tiny_batch(cfg)
    b = batch["input_ids"].shape[0]
    temperature = torch.tensor([0.5, 2.0][:b]) if per_sample else 0.7
    cap = Capture(LogprobEntropyProcessor(temperature=temperature))
    out = model(**batch, output_processor=cap)
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.rand(out["logprobs"].shape, generator=g), torch.rand(out["entropy"].shape, generator=g)
    hidden = cap.kwargs["hidden_states"]  # a non-leaf: its gradient through autograd.grad
    got_h, got_w = torch.autograd.grad(
        (out["logprobs"] * w1 + out["entropy"] * w2).sum(), [hidden, model.output_layer.weight]
    )

    kwargs = dict(cap.kwargs)
    h = kwargs["hidden_states"].detach().double().requires_grad_()
    wt = model.output_layer.weight.detach().double().requires_grad_()
    logits = (h @ wt.t()).transpose(0, 1)
    t = temperature.double()[:, None, None] if per_sample else temperature
    logp = torch.log_softmax(logits / t, -1)
    lp = logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(out["logprobs"].double(), lp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["entropy"].double(), ent.detach(), rtol=1e-5, atol=1e-6)
    (lp * w1.double() + ent * w2.double()).sum().backward()
    assert ((got_w.double() - wt.grad).norm() / wt.grad.norm()) < 1e-5
    assert ((got_h.double() - h.grad).norm() / h.grad.norm()) < 1e-5


def test_ignore_index_gives_zero_and_no_gradient():
    cfg = TinyModelConfig(tied=False)
    model = _hooked(cfg)
    batch = tiny_batch(cfg)
    labels = batch["labels"].clone()
    labels[:, ::3] = -100
    batch["labels"] = labels
    cap = Capture(LogprobEntropyProcessor())
    out = model(**batch, output_processor=cap)
    ignored = labels == -100
    assert (out["logprobs"][ignored] == 0).all() and (out["entropy"][ignored] == 0).all()
    assert (out["logprobs"][~ignored] < 0).all()
    h = cap.kwargs["hidden_states"]
    grad = torch.autograd.grad((out["logprobs"] + out["entropy"]).sum(), h)[0]  # [s, b, h]
    assert (grad.transpose(0, 1)[ignored] == 0).all()
    assert (grad.transpose(0, 1)[~ignored].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
def test_labels_derived_from_input_ids(packed):
    cfg = TinyModelConfig()
    if packed and not supports_packed_sequences(cfg.model_class):
        pytest.skip("no packed sequences on this class")
    model = _hooked(cfg)
    batch = tiny_batch(cfg, packed=packed, with_labels=False)
    derived = model(**batch, output_processor=FusedLogprobProcessor())
    explicit = labels_from_input_ids(batch["input_ids"], -100, batch.get("packed_seq_params"))
    given = model(**batch, labels=explicit, output_processor=FusedLogprobProcessor())
    assert torch.equal(derived, given)
    ids = batch["input_ids"]
    if packed:
        cu = batch["packed_seq_params"].cu_seqlens_q.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            assert torch.equal(explicit[0, start : end - 1], ids[0, start + 1 : end])
            assert explicit[0, end - 1] == -100  # no label crosses a sequence boundary
            assert derived[0, end - 1] == 0
    else:
        assert torch.equal(explicit[:, :-1], ids[:, 1:]) and (explicit[:, -1] == -100).all()


def test_linear_ce_reductions_and_tuple_form():
    cfg = TinyModelConfig()
    stock, model = build_tiny_model(cfg), _hooked(cfg)
    batch = tiny_batch(cfg)
    loss = stock(**batch)
    mask = batch["loss_mask"]
    per_token = model(**batch, output_processor=LinearCEProcessor())
    torch.testing.assert_close(per_token, loss, rtol=1e-5, atol=1e-6)
    total = model(**batch, output_processor=LinearCEProcessor(reduction="sum"))
    mean = model(**batch, output_processor=LinearCEProcessor(reduction="mean"))
    torch.testing.assert_close(total, (loss * mask).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, (loss * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-6)
    pair = model(**batch, output_processor=LogprobEntropyProcessor(as_tuple=True))
    assert isinstance(pair, tuple) and len(pair) == 2 and all(torch.is_tensor(t) for t in pair)
    torch.testing.assert_close(pair[0], -loss, rtol=1e-5, atol=1e-6)
    ent = model(**batch, output_processor=EntropyProcessor())
    torch.testing.assert_close(pair[1], ent)


def test_mup_scale_logits_is_folded_in():
    cfg = TinyModelConfig(tied=False)
    model = _hooked(cfg)
    batch = tiny_batch(cfg)
    cap = Capture(FusedLogprobProcessor())
    base = model(**batch, output_processor=cap)
    kwargs = dict(cap.kwargs, scale_logits=lambda logits: logits * 0.25)
    scaled = FusedLogprobProcessor()(**kwargs)
    logp = torch.log_softmax(_logits64(cap.kwargs) * 0.25, -1)
    ref = logp.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(scaled.double(), ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(scaled, base)
    with pytest.raises(ValueError, match="scale_logits"):
        FusedLogprobProcessor()(**dict(cap.kwargs, scale_logits=lambda logits: logits**2))


def test_processor_errors_name_the_argument():
    cfg = TinyModelConfig()
    model = _hooked(cfg)
    batch = tiny_batch(cfg)
    with pytest.raises(ValueError, match="labels: expected shape"):
        model(**dict(batch, labels=batch["labels"][:, :-1]), output_processor=FusedLogprobProcessor())
    with pytest.raises(ValueError, match="labels: 1 id"):
        bad = batch["labels"].clone()
        bad[0, 0] = cfg.vocab_size
        model(**dict(batch, labels=bad), output_processor=FusedLogprobProcessor())
    with pytest.raises(TypeError, match="labels: expected an integer"):
        model(**dict(batch, labels=batch["labels"].float()), output_processor=FusedLogprobProcessor())
    with pytest.raises(ValueError, match="ignore_index"):
        model(**batch, output_processor=FusedLogprobProcessor(ignore_index=5))
    with pytest.raises(ValueError, match="temperature: expected one per sample"):
        model(**batch, output_processor=FusedLogprobProcessor(temperature=torch.ones(7)))
    for bad_t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            FusedLogprobProcessor(temperature=bad_t)
    with pytest.raises(TypeError, match="temperature"):
        FusedLogprobProcessor(temperature="hot")
    with pytest.raises(ValueError, match="reduction"):
        LinearCEProcessor(reduction="avg")
    with pytest.raises(ValueError, match="backend"):
        FusedLogprobProcessor(backend="cuda-magic")


# --------------------------------------------------------------------------- context parallel


def _cp_check():
    """CP=2: each rank holds half the tokens (labels pre-sharded); results equal the unsplit run."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    g = torch.Generator().manual_seed(5)
    s, b, hidden_size, vocab = 8, 2, 16, 40
    torch.manual_seed(0)
    layer = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(s, b, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    part = slice(rank * s // 2, (rank + 1) * s // 2)
    h_local = hidden[part].clone().requires_grad_()
    out = LogprobEntropyProcessor()(**hook_keywords(h_local, layer, labels=labels[:, part], cp_group=group))
    (out["logprobs"].sum() + out["entropy"].sum()).backward()
    h_full = hidden.clone().requires_grad_()
    full = LogprobEntropyProcessor()(**hook_keywords(h_full, layer, labels=labels))
    (full["logprobs"].sum() + full["entropy"].sum()).backward()
    ok = torch.allclose(out["logprobs"], full["logprobs"][:, part]) and torch.allclose(
        out["entropy"], full["entropy"][:, part]
    ) and torch.allclose(h_local.grad, h_full.grad[part])
    try:
        FusedLogprobProcessor()(**hook_keywords(h_local, layer, input_ids=labels[:, part], cp_group=group))
        refused = False
    except ValueError as e:
        refused = "context parallel" in str(e)
    return ok, refused


def test_context_parallel_local_tokens():
    for ok, refused in run_on_ranks(_cp_check, 2, tp=1, cp=2):
        assert ok and refused


def _cp_reduced_check(reduction: str, all_masked: bool):
    """CP=2, LinearCEProcessor sum/mean with a loss mask: every rank's value is the unsplit
    run's, each rank's hidden-state gradient is the unsplit gradient's slice, and the output
    weight's gradients summed over the CP group are the unsplit one."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    g = torch.Generator().manual_seed(9)
    s, b, hidden_size, vocab = 8, 2, 16, 40
    torch.manual_seed(0)
    layer = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(s, b, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, 1] = -100
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    mask[:, : s // 2] = 0.0  # rank 0's half counts far fewer tokens than rank 1's
    mask[1, 1] = 1.0
    if all_masked:
        mask.zero_()

    def run(h, lab, m, cp_group):
        h = h.clone().requires_grad_()
        layer.zero_grad()
        out = LinearCEProcessor(reduction=reduction)(
            **hook_keywords(h, layer, labels=lab, loss_mask=m, cp_group=cp_group)
        )
        out.backward()
        return out.detach(), h.grad, layer.weight.grad.clone()

    part = slice(rank * s // 2, (rank + 1) * s // 2)
    local, dh, dw = run(hidden[part], labels[:, part], mask[:, part], group)
    dist.all_reduce(dw, group=group)

    full, dh_full, dw_full = run(hidden, labels, mask, None)
    # stock: fp32 logits, per-token cross-entropy, then Megatron's masked sum / mean
    h = hidden.clone().requires_grad_()
    layer.zero_grad()
    ce = torch.nn.functional.cross_entropy(
        (h @ layer.weight.t()).transpose(0, 1).reshape(-1, vocab), labels.reshape(-1),
        reduction="none", ignore_index=-100,
    )
    stock = (ce * mask.reshape(-1)).sum()
    if reduction == "mean":  # as Megatron's schedules: the token count, at least 1
        stock = stock / mask.sum().clamp(min=1)
    stock.backward()
    stock_grads = (h.grad[part], layer.weight.grad.clone())
    return local, full, stock.detach(), dh, dh_full[part], dw, dw_full, stock_grads


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_context_parallel_reduced_loss_is_the_whole_sequences(reduction):
    for local, full, stock, dh, dh_ref, dw, dw_ref, (stock_dh, stock_dw) in run_on_ranks(
        _cp_reduced_check, 2, reduction, False, tp=1, cp=2
    ):
        tol = dict(rtol=1e-5, atol=1e-7)  # fp32 sums in another order
        torch.testing.assert_close(full, stock, **tol)
        torch.testing.assert_close(local, full, **tol)
        torch.testing.assert_close(dh, dh_ref, **tol)
        torch.testing.assert_close(dw, dw_ref, **tol)
        torch.testing.assert_close(dw_ref, stock_dw, **tol)


def test_all_masked_mean_is_zero_like_megatrons_schedules():
    """No position counted: Megatron's schedules divide by the token count clamped to 1, so the
    mean is 0 with zero gradients; so is ours, on every CP rank."""
    for local, full, stock, dh, dh_full, dw, dw_full, (stock_dh, stock_dw) in run_on_ranks(
        _cp_reduced_check, 2, "mean", True, tp=1, cp=2
    ):
        assert stock == 0 and full == 0 and local == 0
        for g in (stock_dh, stock_dw, dh_full, dw_full, dh, dw):
            assert torch.count_nonzero(g) == 0


def test_mup_scaling_through_a_real_model():
    """Where Megatron Core has MuP output scaling (0.17+), processors see it as stock does."""
    cfg = TinyModelConfig(tied=False)
    stock, model = build_tiny_model(cfg), _hooked(cfg)
    if not hasattr(stock, "_scale_logits") or not hasattr(stock.config, "mup_output_mult"):
        pytest.skip("this Megatron Core release has no MuP logit scaling")
    batch = tiny_batch(cfg)
    for m in (stock, model):  # read at forward time by _scale_logits only
        m.config.use_mup = True
        m.config.mup_output_mult = 0.37
    loss = stock(**batch)
    assert not torch.allclose(loss, build_tiny_model(cfg)(**batch))  # the scaling is in effect
    torch.testing.assert_close(model(**batch, output_processor=FusedLogprobProcessor()), -loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(**batch, output_processor=LinearCEProcessor()), loss, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- output-layer pre-hooks


def _hook_kwargs():
    """The hook's keywords from a real forward (untied), for calling processors as the native
    hook does: outside the output layer's own call."""
    cfg = TinyModelConfig(tied=False)
    model = _hooked(cfg)
    batch = tiny_batch(cfg)
    cap = Capture(FusedLogprobProcessor())
    model(**batch, output_processor=cap)
    return model, {k: (v.detach() if torch.is_tensor(v) else v) for k, v in cap.kwargs.items()}


def test_pre_hooks_run_as_calling_the_output_layer_would():
    """A processor that reads the weight runs the output layer's forward pre-hooks exactly as
    ``nn.Module.__call__`` does: global hooks too, hooks with kwargs, results honoured."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    model, kwargs = _hook_kwargs()
    layer = model.output_layer
    plain = FusedLogprobProcessor()(**kwargs)
    calls = []

    def global_hook(module, args):
        if module is layer:
            calls.append(("global", len(args)))

    def kwargs_hook(module, args, kw):
        calls.append(("kwargs", tuple(kw)))
        return args, dict(kw, weight=module.weight * 0.5)  # a new weight, as FSDP would unshard

    def args_hook(module, args):
        calls.append(("args", len(args)))
        return args[0] * 3.0  # a lone tensor stands for the 1-tuple, as in torch

    handles = [
        register_module_forward_pre_hook(global_hook),
        layer.register_forward_pre_hook(kwargs_hook, with_kwargs=True),
        layer.register_forward_pre_hook(args_hook),
    ]
    try:
        hooked = FusedLogprobProcessor()(**kwargs)
        # what the output layer itself gets from the same hooks
        seen = {}
        spy = layer.register_forward_pre_hook(
            lambda m, a, kw: seen.update(x=a[0], w=kw["weight"]), with_kwargs=True
        )
        calls.clear()
        layer(kwargs["hidden_states"], weight=None, runtime_gather_output=None)
        spy.remove()
        order_via_call = list(calls)
        calls.clear()
        FusedLogprobProcessor()(**kwargs)
    finally:
        for h in handles:
            h.remove()
    assert calls == order_via_call == [("global", 1), ("kwargs", ("weight", "runtime_gather_output")), ("args", 1)]
    ref = FusedLogprobProcessor()(**dict(kwargs, hidden_states=seen["x"], output_weight=seen["w"]))
    torch.testing.assert_close(hooked, ref, rtol=0, atol=0)
    assert not torch.allclose(hooked, plain)  # the hooks' new arguments were used


def test_pre_hooks_are_not_run_twice_on_the_backport():
    """On the backport the processor runs inside the output layer's pre-hooks: they ran once."""
    cfg = TinyModelConfig(tied=False)
    model = build_tiny_model(cfg, model_cls=hooked.backport_class(stock_model_class("gpt")))
    count = []
    model.output_layer.register_forward_pre_hook(lambda m, a, kw: count.append(1), with_kwargs=True)
    model(**tiny_batch(cfg), output_processor=FusedLogprobProcessor())
    assert count == [1]


# --------------------------------------------------------------------------- construction, debug checks


def test_construction_errors_name_the_class_and_argument():
    cfg = TinyModelConfig()
    model = enable_output_processor(build_tiny_model(cfg))
    batch = tiny_batch(cfg)
    with pytest.raises(TypeError, match=r"got the class FusedLogprobProcessor, expected an instance"):
        model(**batch, output_processor=FusedLogprobProcessor)  # native hook or backport alike
    with pytest.raises(TypeError, match=r"FusedLogprobProcessor\(\) takes keyword arguments only"):
        FusedLogprobProcessor(0.7)
    with pytest.raises(TypeError, match=r"FusedLogprobProcessor.__init__\(\) got an unexpected keyword argument 'temprature'"):
        FusedLogprobProcessor(temprature=0.7)
    cases = [
        (dict(chunk_size=0), ValueError, "chunk_size: expected a positive int"),
        (dict(chunk_size=2.0), ValueError, "chunk_size"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
        (dict(backend="cuda"), ValueError, "backend: expected one of"),
        (dict(temperature=torch.ones(2, 2)), ValueError, "temperature: expected a positive float or a 1-D"),
        (dict(temperature=torch.tensor([1.0, 0.0])), ValueError, "temperature: every value"),
        (dict(temperature=torch.tensor([1, 2])), ValueError, "temperature"),
    ]
    for cls in (FusedLogprobProcessor, EntropyProcessor, LogprobEntropyProcessor, LinearCEProcessor):
        for kwargs, err, msg in cases:
            with pytest.raises(err, match=msg):
                cls(**kwargs)
    with pytest.raises(TypeError, match="as_tuple: expected True or False"):
        LogprobEntropyProcessor(as_tuple="yes")
    with pytest.raises(TypeError, match="mask_from_labels"):
        EntropyProcessor(mask_from_labels=None)


def test_unchecked_bad_values_give_nan_not_numbers():
    """With value checks off (CUDA's default), an out-of-range label or a non-positive per-token
    temperature makes that token's results NaN instead of a plausible wrong number."""
    from mcore_hooks.debug import debug_checks
    from mcore_hooks.kernels import linear_cross_entropy, linear_logprob_entropy

    x, w = torch.randn(4, 8), torch.randn(10, 8)
    labels = torch.tensor([1, 10, 3, -100])  # 10 is not a vocabulary id
    temperature = torch.tensor([1.0, 1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="labels: 1 id"):  # CPU tensors: checked by default
        linear_logprob_entropy(x, w, labels)
    with debug_checks(False):  # as on CUDA by default: no value is read on the host
        r = linear_logprob_entropy(x, w, labels, temperature=temperature)
        ce = linear_cross_entropy(x, w, torch.tensor([1, 2, 10, -100]))
    assert torch.isnan(r.logprob[1]) and torch.isnan(r.entropy[1])
    assert torch.isnan(r.logprob[2]) and torch.isnan(r.entropy[2])
    assert torch.isfinite(r.logprob[0]) and r.logprob[3] == 0
    assert torch.isnan(ce)
    with debug_checks(True), pytest.raises(ValueError, match="temperature: every value"):
        linear_logprob_entropy(x, w, torch.tensor([1, 2, 3, -100]), temperature=temperature)


def test_logit_scale_is_read_from_megatrons_config():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.count += 1
            return func(*args, **(kwargs or {}))

    cfg = TinyModelConfig(tied=False)
    model = _hooked(cfg)
    assert compat.logit_scale(types.MethodType(compat.identity_scale_logits, model), model.config) == 1.0
    assert compat.logit_scale(lambda t: t * 0.25, model.config) == 0.25  # other callables: probed
    with pytest.raises(ValueError, match="not a constant factor"):
        compat.logit_scale(lambda t: t**2, model.config)
    if not hasattr(model, "_scale_logits") or not hasattr(model.config, "mup_output_mult"):
        pytest.skip("this Megatron Core release has no MuP logit scaling")
    model.config.use_mup, model.config.mup_output_mult = True, 0.37
    try:
        with CountOps():
            scale = compat.logit_scale(model._scale_logits, model.config)
        assert scale == 0.37 and CountOps.count == 0  # read, not probed
    finally:
        model.config.use_mup, model.config.mup_output_mult = False, 1.0


def test_packed_labels_and_temperatures_follow_padded_sequences():
    """THD batches with per-sequence padding (cu_seqlens_q_padded): each sequence's labels are
    its own next tokens, its last token and its padding are ignored, and its temperature covers
    its padded span."""
    from mcore_hooks.processors.labels import per_token_temperature

    params = types.SimpleNamespace(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),  # lengths 3 and 2
        cu_seqlens_q_padded=torch.tensor([0, 4, 8], dtype=torch.int32),  # padded to 4 each
    )
    ids = torch.arange(100, 109).unsqueeze(0)  # 9 positions: the last is trailing padding
    labels = labels_from_input_ids(ids, -100, params)
    assert labels.tolist() == [[101, 102, -100, -100, 105, -100, -100, -100, -100]]
    t = per_token_temperature(torch.tensor([0.5, 2.0]), 1, 9, params)
    assert t.tolist() == [0.5] * 4 + [2.0] * 5
