"""Errors in the user's words: what a newcomer meets through the public API on a tiny CPU model
names what they passed (the processor's options, ``output_processor_context[...]``, the model's
dtype), never an internal name, and says what to do."""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import (
    FusedLogprobProcessor,
    LogprobEntropyProcessor,
    PolicyLossProcessor,
    debug_checks,
)
from mcore_hooks.kernels import PolicyLoss, triton_unavailable
from mcore_hooks.testing import hook_keywords

S, B, H, V = 4, 2, 8, 30


def _keywords(dtype=torch.float32, context=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(H, V, bias=False).to(dtype)
    hidden = torch.randn(S, B, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    return hook_keywords(hidden, layer, labels=labels, context=context), labels


def _policy_context(labels, **extra):
    g = torch.Generator().manual_seed(3)
    return {"old_logprobs": -torch.rand(B, S, generator=g), "advantages": torch.randn(B, S, generator=g), **extra}


def test_a_float64_model_is_named_as_the_models_dtype():
    kw, _ = _keywords(torch.float64)
    with pytest.raises(TypeError, match="the model's hidden states are torch.float64: .* float32, bfloat16 or float16 models"):
        FusedLogprobProcessor()(**kw)


def test_a_bad_sampling_mask_id_names_the_context_key():
    kw, labels = _keywords()
    mask = torch.stack([labels, (labels + 1) % V], -1)
    mask[0, 1, 1] = V + 3
    kw["context"] = {"sampling_mask": mask}
    with debug_checks(True), pytest.raises(ValueError, match=r"output_processor_context\['sampling_mask'\]: ids must"):
        LogprobEntropyProcessor(kept_set="replay")(**kw)


def test_nan_in_a_policy_input_names_the_context_key():
    kw, labels = _keywords()
    ctx = _policy_context(labels)
    ctx["old_logprobs"][1, 2] = float("nan")
    kw["context"] = ctx
    with debug_checks(True), pytest.raises(ValueError, match=r"output_processor_context\['old_logprobs'\]: NaN"):
        PolicyLossProcessor()(**kw)


def test_a_loss_functions_missing_input_is_named():
    """A per-token function's inputs come from its signature: one missing from the context is
    named there, not left to the function's own TypeError."""
    kw, labels = _keywords()
    kw["context"] = {"old_logprobs": torch.zeros(B, S)}

    def loss(logprob, entropy, old_logprobs, advantages, scale=1.0):
        return -advantages * scale * (logprob - old_logprobs).exp()

    with pytest.raises(ValueError, match=r"output_processor_context: missing 'advantages' \(the loss takes 'old_logprobs', 'advantages' \(and accepts 'scale'\)\)"):
        PolicyLossProcessor(loss=loss)(**kw)
    kw["context"] = {"old_logprobs": torch.zeros(B, S), "advantages": torch.ones(B, S), "typo": torch.ones(B, S)}
    with pytest.raises(ValueError, match="unexpected 'typo'"):
        PolicyLossProcessor(loss=loss)(**kw)


def test_a_known_input_the_loss_does_not_use_is_accepted_an_unknown_one_refused():
    """A trainer passes the same inputs whatever the loss: ref_logprobs with kl_coef 0 is left
    aside; a key no configuration takes is still refused."""
    kw, labels = _keywords()
    kw["context"] = _policy_context(labels, ref_logprobs=torch.zeros(B, S))
    with_ref = PolicyLossProcessor(loss=PolicyLoss(kl_coef=0.0))(**kw)["loss"]
    kw["context"] = _policy_context(labels)
    without = PolicyLossProcessor(loss=PolicyLoss(kl_coef=0.0))(**kw)["loss"]
    assert torch.equal(with_ref, without)
    kw["context"] = _policy_context(labels, advantage=torch.zeros(B, S))
    with pytest.raises(ValueError, match="unexpected 'advantage'"):
        PolicyLossProcessor()(**kw)


def test_backend_triton_is_refused_when_the_processor_is_built():
    why = triton_unavailable()
    if why is None:
        pytest.skip("Triton can run here")
    with pytest.raises(ValueError, match="backend: 'triton' cannot run on this machine"):
        FusedLogprobProcessor(backend="triton")


def test_loss_functions_of_any_signature_take_their_inputs():
    """The inputs of a per-token function are read from its signature past logprob and entropy;
    ``*args`` takes those two, ``**kwargs`` takes anything (a wrapper, a lambda)."""
    from mcore_hooks.kernels import linear_policy_loss

    g = torch.Generator().manual_seed(0)
    n = 6
    x, w = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (n,), generator=g)
    inputs = {"old_logprobs": torch.zeros(n), "advantages": torch.ones(n)}

    def wrapper(*a, **k):  # a decorator without functools.wraps
        return -k["advantages"] * a[0]

    def named(logprob, entropy, *, old_logprobs, advantages):
        return -advantages * logprob

    def kwargs_only(logprob, entropy, **inputs):
        return -inputs["advantages"] * logprob

    want = linear_policy_loss(x, w, y, token_weight=torch.ones(n), inputs=inputs, loss=named).loss
    for fn in (wrapper, kwargs_only, lambda *a, **k: -k["advantages"] * a[0]):
        got = linear_policy_loss(x, w, y, token_weight=torch.ones(n), inputs=inputs, loss=fn).loss
        assert torch.equal(got, want)


def test_a_policy_loss_subclass_may_take_an_input_of_its_own():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Weighted(PolicyLoss):
        @property
        def input_names(self):
            return super().input_names + ("weights",)

        def __call__(self, logprob, entropy, *, weights, **inputs):
            return super().__call__(logprob, entropy, **inputs) * weights

    kw, labels = _keywords()
    kw["context"] = _policy_context(labels, weights=torch.full((B, S), 2.0))
    two = PolicyLossProcessor(loss=Weighted())(**kw)["loss"]
    kw["context"] = _policy_context(labels)
    one = PolicyLossProcessor()(**kw)["loss"]
    torch.testing.assert_close(two, 2 * one)
    with pytest.raises(ValueError, match="missing 'weights'"):
        PolicyLossProcessor(loss=Weighted())(**kw)


def test_a_processors_repr_shows_its_options():
    """In a log or a debugger a processor says what it will do: its class and options."""
    text = repr(PolicyLossProcessor(temperature=0.7, aggregation="seq-mean-token-sum"))
    assert text.startswith("PolicyLossProcessor(") and "temperature=0.7" in text
    assert "aggregation='seq-mean-token-sum'" in text and "loss=PolicyLoss(clip_low=0.2" in text
    per_sample = repr(PolicyLossProcessor(temperature=torch.full((3,), 0.5)))
    assert "temperature=tensor(shape=(3,), dtype=torch.float32)" in per_sample


def _processor_classes():
    """Every public processor class: the package's exports and both integrations."""
    import mcore_hooks
    from mcore_hooks import PostprocessProcessor
    from mcore_hooks.integrations import NemoRLLogprobProcessor, VerlFusedProcessor

    exported = [getattr(mcore_hooks, n) for n in mcore_hooks.__all__]
    classes = [c for c in exported if isinstance(c, type) and issubclass(c, PostprocessProcessor)
               and c is not PostprocessProcessor]
    return classes + [VerlFusedProcessor, NemoRLLogprobProcessor]


@pytest.mark.parametrize("cls", _processor_classes(), ids=lambda c: c.__name__)
def test_a_processor_called_with_positional_arguments_says_to_pass_it_to_the_model(cls):
    """``proc(hidden, labels)`` (as one calls a loss function) is not how the hook calls it: the
    error names the processor and says model(..., output_processor=...), not Python's bare
    "__call__() takes 1 positional argument but 3 were given"."""
    kw, labels = _keywords()
    proc = cls()
    for args in ((kw["hidden_states"], labels), ()):
        with pytest.raises(TypeError) as err:
            proc(*args)
        msg = str(err.value)
        assert f"{cls.__name__} is an output processor" in msg, msg
        assert f"model(..., output_processor={cls.__name__}(...))" in msg, msg
        assert (f"got {len(args)} positional argument(s)" if args else "got no arguments") in msg, msg
        assert "takes 1 positional argument" not in msg
    # the hook's call, keywords only, still reaches the processor (those needing a context say
    # so; DefaultProcessor calls the output layer, a plain Linear here)
    if cls.__name__ == "DefaultProcessor":
        return
    if cls.__name__ in ("PolicyLossProcessor", "SelectedLogprobProcessor", "TopKDistillationProcessor"):
        with pytest.raises(ValueError, match="output_processor_context"):
            proc(**kw)
    else:
        assert proc(**kw) is not None
