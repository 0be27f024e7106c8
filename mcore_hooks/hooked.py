"""The hooked classes: upstream's ``output_processor`` keywords delivered on every supported
release and model class, assembled from the protocol (:mod:`.postprocess`), the MTP loss hook
(:mod:`.mtp`) and the schedule plan's seam (:mod:`.schedule_plan`); the only module that imports
all three.

* :class:`BackportHookMixin` delivers the call on classes without the hook (in ``forward`` and
  ``build_schedule_plan``); :class:`NativeHookMixin` passes a native class's calls through,
  adding the MTP loss hook with MTP on and a plan post-process backward that tolerates outputs
  the loss did not use;
* :func:`hooked_class`, :func:`enable_output_processor`, :func:`supports_output_processor`
  (public), and ``HookedGPTModel`` & co., made on first use.

How the backport works, and why this way: the stock ``forward`` of every supported class ends by
calling ``self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=...)`` and
then turning the logits into the returned loss or logits. The mixin runs the *stock* ``forward``
unchanged and, for that one call only, has the model's own ``output_layer`` instance (its class
swapped for the call and back: ``__call__`` is looked up on the type; nothing global) hand the
call to the processor, with the same hidden states and weight the output layer would have been
called with, before any of the layer's hooks run, as upstream calls the processor instead of the
layer; then unwinds the stock ``forward`` with the result. No Megatron code is copied, so
embedding, decoder, sequence-parallel scatter and packed-sequence handling stay exactly stock. A
processor that reads the weight itself runs the layer's forward pre-hooks first
(:func:`mcore_hooks.compat.output_layer_inputs`: the distributed optimizer's all-gather wait), as
upstream's do.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from . import compat, schedule_plan
from .mtp import MTPCalls, mtp_loss_hook, mtp_loss_of, native_mtp_loss
from .postprocess import check_output_processor

__all__ = ["enable_output_processor", "hooked_class", "supports_output_processor"]

ModelT = TypeVar("ModelT", bound=Union[torch.nn.Module, list, tuple])


class _ProcessorResult(BaseException):
    """Carries the processor's result out of the stock forward.

    A BaseException so that no ``except Exception`` in stock code between the output layer and
    our ``forward`` can swallow it.
    """

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


# The call being intercepted, per output layer: a function of the call's (args, kwargs) that
# raises _ProcessorResult, or returns to let the call run as usual.
_INTERCEPT: contextvars.ContextVar[dict] = contextvars.ContextVar("mcore_hooks_intercept", default={})


class _InterceptedCall:
    """Put in front of an output layer's class for one stock call: ``layer(...)`` asks the
    interception first. ``__call__`` is looked up on the type, so only the class can take it;
    the instance's class is swapped back on the way out."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        intercept = _INTERCEPT.get().get(id(self))
        if intercept is not None:
            intercept(args, kwargs)
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def _intercepted_class(cls: type) -> type:
    return type(cls.__name__, (_InterceptedCall, cls), {"__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})


def call_processor_at_output_layer(
    model: Any,
    run: Callable[[], Any],
    output_processor: Callable[..., Any],
    keywords: Callable[[], dict],
    mtp_calls: MTPCalls,
) -> tuple[bool, Any]:
    """Run ``run()``, a stock code path ending in ``model.output_layer(hidden, weight=...)``, with
    ``output_processor`` called in place of that call.

    For that call only, the model's own output layer (this instance: its class is swapped for
    the call and back) hands the call to the processor before anything of the layer runs, as
    upstream calls the processor instead of the layer: none of the layer's hooks run unless the
    processor calls the layer (``ctx.logits()``) or reads its inputs (``ctx.output_layer_inputs()``
    runs its forward pre-hooks, the distributed optimizer's all-gather wait among them). The
    processor gets the hidden states and weight the layer was called with, ``output_layer``, and
    ``keywords()`` for upstream's other keywords; ``run()`` is then unwound with its result. The
    MTP depths' output-layer calls before it (``mtp_calls``) pass through, as upstream's hook
    runs the MTP step first. Returns ``(True, result)``, or ``(False, run()'s own result)`` if
    the output layer was never reached.
    """
    layer = model.output_layer
    fired: list[bool] = []

    def intercept(o_args: tuple, o_kwargs: dict) -> None:
        if fired:  # the processor itself may run the output layer (ctx.logits())
            return
        hidden = o_args[0] if o_args else o_kwargs.get("input_")
        if mtp_calls.depth(hidden):
            return
        fired.append(True)
        result = output_processor(
            hidden_states=hidden,
            output_layer=layer,
            output_weight=o_kwargs.get("weight"),
            **keywords(),
        )
        raise _ProcessorResult(result)

    stock_class = type(layer)
    token = _INTERCEPT.set({**_INTERCEPT.get(), id(layer): intercept})
    layer.__class__ = _intercepted_class(stock_class)
    try:
        return False, run()
    except _ProcessorResult as done:
        return True, done.value
    finally:
        layer.__class__ = stock_class
        _INTERCEPT.reset(token)


class BackportHookMixin:
    """Adds upstream's ``output_processor`` / ``output_processor_context`` keywords to ``forward``
    and ``build_schedule_plan``.

    Put first in the bases of a Megatron Core language-model class that lacks them. With
    ``output_processor=None`` the stock methods run untouched (bit-identical results).
    """

    def forward(
        self,
        *args: Any,
        output_processor: Optional[Callable[..., Any]] = None,
        output_processor_context: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        stock_forward = super().forward  # type: ignore[misc]
        if output_processor is None:
            return stock_forward(*args, **kwargs)
        check_output_processor(output_processor)
        model: Any = self
        try:
            bound = inspect.signature(stock_forward).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}.forward: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        inference_context = a.get("inference_context")
        if inference_context is None:
            inference_context = a.get("inference_params")
        # decoder_input in the protocol is the decoder's input as the model's preprocessing built it
        # (the embedding output, or the caller's decoder_input, or None on non-first stages).
        seen: dict[str, Any] = {}

        def capture_decoder_input(_m: Any, d_args: tuple, d_kwargs: dict) -> None:
            seen["decoder_input"] = d_kwargs.get("hidden_states", d_args[0] if d_args else None)

        def keywords() -> dict:
            return dict(
                labels=a.get("labels"),
                loss_mask=a.get("loss_mask"),
                input_ids=a.get("input_ids"),
                position_ids=a.get("position_ids"),
                attention_mask=a.get("attention_mask"),
                decoder_input=seen.get("decoder_input"),
                inference_context=inference_context,
                packed_seq_params=a.get("packed_seq_params"),
                runtime_gather_output=a.get("runtime_gather_output"),
                context=output_processor_context,
                compute_language_model_loss=model.compute_language_model_loss,
                scale_logits=compat.scale_logits_of(model),
                config=model.config,
            )

        def run() -> Any:
            with compat.full_sequence_logits(inference_context):
                return stock_forward(*args, **kwargs)

        if not getattr(model, "post_process", False):
            return run()  # not the last pipeline stage: hidden states, processor never runs
        handle = None
        if getattr(model, "decoder", None) is not None:
            handle = model.decoder.register_forward_pre_hook(capture_decoder_input, with_kwargs=True)
        try:
            with MTPCalls(model) as calls, mtp_loss_hook(model, mtp_loss_of(output_processor), calls,
                                                         a.get("labels")):
                called, out = call_processor_at_output_layer(
                    model, run, output_processor, keywords, calls
                )
        finally:
            if handle is not None:
                handle.remove()
        if not called:
            raise RuntimeError(
                f"{type(self).__name__}.forward returned without reaching its output layer, so "
                "output_processor was not called; this path is not supported by the backport"
            )
        return out

    def build_schedule_plan(
        self,
        *args: Any,
        output_processor: Optional[Callable[..., Any]] = None,
        output_processor_context: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        stock = getattr(super(), "build_schedule_plan", None)
        if stock is None:
            raise NotImplementedError(no_schedule_plan_reason(type(self)))
        plan = stock(*args, **kwargs)
        if output_processor is None:
            return plan
        return schedule_plan.attach_processor(self, plan, output_processor, output_processor_context,
                                              call_processor_at_output_layer)


def no_schedule_plan_reason(cls: type) -> str:
    """Why ``cls`` has no ``build_schedule_plan`` on the installed Megatron Core."""
    gpt = compat.model_class("gpt")
    if gpt is not None and issubclass(cls, gpt):
        return (
            f"{cls.__name__}.build_schedule_plan: this Megatron Core release has no combined-1F1B "
            "schedule plan (GPTModel.build_schedule_plan arrived in 0.14)"
        )
    return (
        f"{cls.__name__}.build_schedule_plan: HybridModel and MambaModel have no combined-1F1B "
        "schedule plan in any Megatron Core release (upstream PR #4942 adds one to HybridModel); "
        "with the ordinary schedules, forward(..., output_processor=...) works on them"
    )


class NativeHookMixin:
    """For a class with upstream's hook (0.18+ GPTModel): ``forward`` and
    ``build_schedule_plan`` are upstream's calls, passed through, with two additions where
    upstream falls short: with MTP on (and a ``process_mtp_loss`` without a per-depth callable)
    the processor's ``mtp_loss`` (:mod:`mcore_hooks.mtp`) computes the depths' loss; and the
    plan's post-process node backpropagates only the outputs the loss function used
    (:func:`mcore_hooks.schedule_plan.attach_native`), where upstream's crashes on a detached
    or unused element of a tuple result."""

    def forward(self, *args: Any, output_processor: Optional[Callable[..., Any]] = None,
                output_processor_context: Optional[Any] = None, **kwargs: Any) -> Any:
        native = super().forward  # type: ignore[misc]
        if output_processor is not None:
            check_output_processor(output_processor)
        model: Any = self
        mtp_loss = native_mtp_loss(model, output_processor)
        labels = inspect.signature(native).bind_partial(*args, **kwargs).arguments.get("labels") if mtp_loss else None
        with MTPCalls(model) as calls, mtp_loss_hook(model, mtp_loss, calls, labels):
            return native(*args, output_processor=output_processor,
                          output_processor_context=output_processor_context, **kwargs)

    def build_schedule_plan(self, *args: Any, output_processor: Optional[Callable[..., Any]] = None,
                            output_processor_context: Optional[Any] = None, **kwargs: Any) -> Any:
        stock = getattr(super(), "build_schedule_plan", None)
        if stock is None:  # a native hook without a plan (HybridModel with upstream/0001)
            raise NotImplementedError(no_schedule_plan_reason(type(self)))
        if output_processor is not None:
            check_output_processor(output_processor)
        plan = stock(  # type: ignore[misc]
            *args, output_processor=output_processor,
            output_processor_context=output_processor_context, **kwargs
        )
        return schedule_plan.attach_native(self, plan, output_processor)


def _hooked_subclass(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front, named ``Hooked<cls>``: same constructor and state dict."""
    name = cls.__name__ if cls.__name__.startswith("Hooked") else f"Hooked{cls.__name__}"
    return type(
        name,
        (mixin, cls),
        {"__module__": "mcore_hooks.hooked", "__qualname__": name, "__doc__": cls.__doc__},
    )


@functools.lru_cache(maxsize=None)
def native_class(cls: type) -> type:
    """``cls`` (with upstream's hook) with :class:`NativeHookMixin` in front, once per ``cls``."""
    return _hooked_subclass(NativeHookMixin, cls)


@functools.lru_cache(maxsize=None)
def backport_class(cls: type) -> type:
    """``cls`` with :class:`BackportHookMixin` in front, once per ``cls``."""
    return _hooked_subclass(BackportHookMixin, cls)


def hooked_class(cls: type) -> type:
    """The class to build for a model whose ``forward`` takes ``output_processor``.

    Args:
        cls: GPTModel, HybridModel or MambaModel, or a subclass of one.

    Returns:
        A subclass with the same constructor and state dict: where ``cls`` already has
        upstream's hook (GPTModel on Megatron Core >= 0.18), one that passes the native calls
        through, adding only the MTP loss hook and a plan post-process backward that tolerates
        tuple outputs the loss did not use; otherwise one adding the hook (in ``forward`` and
        ``build_schedule_plan``).

    Raises:
        TypeError: ``cls`` is not a supported language-model class.
    """
    if not compat.is_language_model_class(cls):
        names = ", ".join(compat.language_model_classes())
        raise TypeError(f"cls: expected a subclass of {names}, got {cls!r}")
    if issubclass(cls, (BackportHookMixin, NativeHookMixin)):
        return cls
    if compat.has_native_hook(cls):
        return native_class(cls)
    return backport_class(cls)


def supports_output_processor(model: torch.nn.Module) -> bool:
    """Whether ``model.forward(..., output_processor=...)`` works as upstream's hook (by detection).

    Args:
        model: a language model, possibly inside DDP / Float16Module wrappers.

    Returns:
        True where ``forward`` takes the keywords (natively or after
        :func:`enable_output_processor`); False otherwise, and for anything that is not a
        supported Megatron Core language model.
    """
    try:
        inner = compat.unwrap_model(model)
    except TypeError:
        return False
    return compat.forward_accepts(type(inner), "output_processor")


def enable_output_processor(model: ModelT) -> ModelT:
    """Make ``model.forward(..., output_processor=...)`` work on the installed Megatron Core.

    ``model`` is a GPTModel, HybridModel or MambaModel (or subclass), possibly inside DDP /
    Float16Module wrappers, or a list of such model chunks (virtual pipeline). Where upstream has
    the hook (GPTModel on Megatron Core >= 0.18), the model is left as it is unless it asks for
    something upstream lacks (multi-token prediction, whose
    depths upstream computes from logits, or the combined-1F1B schedule, whose post-process
    backward upstream runs over every output: decided from the config when this is called, so
    call it once the config is final); then, and where the class lacks the hook, only this
    instance's class is switched, to :func:`hooked_class` (never a global patch). Idempotent.

    Args:
        model: the model, a wrapper around it, or a list of model chunks.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: no supported language model is found in ``model``.
    """
    if isinstance(model, (list, tuple)):
        for chunk in model:
            enable_output_processor(chunk)
        return model
    inner = compat.unwrap_model(model)
    cls = type(inner)
    if compat.has_native_hook(cls) and not _asks_beyond_upstream(model, inner):
        return model  # upstream's own hook does everything this model asks for
    target = hooked_class(cls)
    if target is not cls:
        inner.__class__ = target
    return model


def _asks_beyond_upstream(model: Any, inner: torch.nn.Module) -> bool:
    """Whether a model whose class has upstream's hook asks for what upstream lacks: MTP on, where
    ``process_mtp_loss`` takes no per-depth loss (every depth would build ``[tokens, vocab]``
    logits), or the combined-1F1B schedule (``overlap_moe_expert_parallel_comm`` in the config
    Megatron's schedules read, the outermost wrapper's, or the model's own: upstream's plan
    post-process backward needs a gradient for every output, which a loss that leaves one unused
    does not give)."""
    if compat.mtp_enabled(inner) and not compat.native_mtp_loss_fn():
        return True
    return any(getattr(getattr(m, "config", None), "overlap_moe_expert_parallel_comm", False) for m in (model, inner))


def __getattr__(name: str) -> type:
    # HookedGPTModel / HookedHybridModel / HookedMambaModel, made on first use for the installed
    # release; absent classes get an error that says which release has them.
    if name.startswith("Hooked") and name.endswith("Model"):
        base = name[len("Hooked") :]
        classes = compat.language_model_classes()
        if base in classes:
            cls = hooked_class(classes[base])
            globals()[name] = cls
            return cls
        if base in ("GPTModel", "HybridModel", "MambaModel"):
            import megatron.core

            raise AttributeError(
                f"{name}: the installed Megatron Core {megatron.core.__version__} has no {base}"
                + (" (HybridModel arrived in 0.18)" if base == "HybridModel" else "")
            )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
