"""The ``output_processor`` protocol: context, processor base class, and enabling the hook.

The call convention is Megatron Core's own (>= 0.18, ``GPTModel.forward(..., output_processor=,
output_processor_context=)``): after the decoder (and the MTP step) the last pipeline stage calls
``output_processor(**OUTPUT_PROCESSOR_KEYWORDS)`` instead of its output layer and returns what the
processor returns. :func:`enable_output_processor` makes the same call happen on every supported
release and class; code written against this module runs unchanged on stock Megatron Core >= 0.18
GPTModel.

Contract (documented and tested): the processor never runs on non-last pipeline stages (they return
hidden states); ``hidden_states`` are ``[s, b, h]``, ``[s/tp, b, h]`` when sequence parallel is on,
and context-parallel local under CP; a processor that ignores a keyword must still accept it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

import torch

from . import compat
from .compat import OUTPUT_PROCESSOR_KEYWORDS, check_output_processor

__all__ = [
    "OUTPUT_PROCESSOR_KEYWORDS",
    "PostprocessContext",
    "PostprocessProcessor",
    "DefaultProcessor",
    "enable_output_processor",
    "supports_output_processor",
    "hooked_class",
    "check_output_processor",
]


@dataclasses.dataclass(frozen=True)
class PostprocessContext:
    """The 16 keywords of one ``output_processor`` call, plus the facts a processor derives from them.

    Build it with :meth:`from_kwargs`. The first 16 fields are upstream's keywords, as passed.

    Attributes:
        hidden_states: ``[s, b, h]``; this rank's ``[s/tp, b, h]`` shard under sequence
            parallelism; context-parallel local under CP; ``[t, 1, h]`` for packed (THD) input.
        extra: keywords a later Megatron Core may add, kept as passed.
        weight: the effective output weight as passed (``output_weight`` when embeddings are
            tied, else the layer's), before the output layer's pre-hooks: a processor that reads
            the weight itself takes it from :meth:`output_layer_inputs`.
        tp_group: the output layer's tensor-parallel group (None: not split).
        tp_rank: this rank in ``tp_group``.
        tp_size: the size of ``tp_group``.
        vocab_start: the global id of this rank's first vocabulary row.
        vocab_end: one past the global id of this rank's last vocabulary row.
        sequence_parallel: ``hidden_states`` is this rank's token shard.
        cp_group: the model's context-parallel group (None without CP).
        cp_size: the size of ``cp_group``.
    """

    # Upstream's keywords.
    hidden_states: torch.Tensor
    output_layer: torch.nn.Module
    output_weight: Optional[torch.Tensor]
    labels: Optional[torch.Tensor]
    loss_mask: Optional[torch.Tensor]
    input_ids: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    attention_mask: Optional[torch.Tensor]
    decoder_input: Optional[torch.Tensor]
    inference_context: Any
    packed_seq_params: Any
    runtime_gather_output: Optional[bool]
    context: Any
    compute_language_model_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale_logits: Callable[[torch.Tensor], torch.Tensor]
    config: Any
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Derived. ``weight`` is the effective output weight as passed (``output_weight`` when
    # embeddings are tied, else the layer's), before the output layer's pre-hooks: a processor
    # that reads it directly takes it from :meth:`output_layer_inputs` instead.
    weight: torch.Tensor = dataclasses.field(default=None)  # type: ignore[assignment]
    tp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    vocab_start: int = 0
    vocab_end: int = 0
    sequence_parallel: bool = False
    cp_group: Any = None
    cp_size: int = 1

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "PostprocessContext":
        """Build the context from the keywords the hook passed.

        Args:
            kwargs: the keywords of the ``output_processor`` call.

        Returns:
            The context.

        Raises:
            TypeError: a keyword of upstream's 16 is missing (named).
        """
        missing = [k for k in OUTPUT_PROCESSOR_KEYWORDS if k not in kwargs]
        if missing:
            raise TypeError(
                f"output_processor call is missing keyword(s) {', '.join(missing)}; the hook "
                f"passes {', '.join(OUTPUT_PROCESSOR_KEYWORDS)}"
            )
        known = {k: kwargs[k] for k in OUTPUT_PROCESSOR_KEYWORDS}
        extra = {k: v for k, v in kwargs.items() if k not in known}
        layer = known["output_layer"]
        # Tied embeddings pass the embedding's weight; otherwise the output layer owns it.
        weight = known["output_weight"] if known["output_weight"] is not None else layer.weight
        layout = compat.vocab_layout(layer, weight)
        cp_group = compat.context_parallel_group(known["compute_language_model_loss"], known["config"])
        return cls(
            **known,
            extra=extra,
            weight=weight,
            tp_group=layout.group,
            tp_rank=layout.rank,
            tp_size=layout.size,
            vocab_start=layout.vocab_start,
            vocab_end=layout.vocab_start + weight.shape[0],
            sequence_parallel=layout.sequence_parallel,
            cp_group=cp_group,
            cp_size=compat.group_rank_size(cp_group)[1],
        )

    def output_layer_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, weight)`` exactly as the output layer's ``forward`` would get them.

        Call it once, instead of reading ``hidden_states`` / ``weight``, in a processor that reads
        the weight itself rather than calling ``output_layer``: it runs the layer's forward
        pre-hooks as calling the layer would (the distributed optimizer's wait for the overlapped
        parameter all-gather, Megatron-FSDP's unshard; their return values honoured), so the
        weight is never stale. The processor is called before any of the layer's hooks run
        (natively and on the backport), so they run once, here.

        Returns:
            ``(hidden_states, weight)`` after the output layer's forward pre-hooks.
        """
        return compat.output_layer_inputs(
            self.output_layer, self.hidden_states, self.output_weight, self.runtime_gather_output
        )

    def logit_scale(self) -> float:
        """The constant factor ``scale_logits`` applies.

        Returns:
            Megatron's MuP output scale (read from the config), 1 without.

        Raises:
            ValueError: ``scale_logits`` is not a constant factor.
        """
        return compat.logit_scale(self.scale_logits, self.config)

    def logits(self) -> torch.Tensor:
        """The stock logits: the output layer, then MuP scaling.

        Returns:
            ``[s, b, vocab/tp]``, or gathered ``[s, b, vocab]`` with ``runtime_gather_output``.
        """
        logits, _ = self.output_layer(
            self.hidden_states,
            weight=self.output_weight,
            runtime_gather_output=self.runtime_gather_output,
        )
        return self.scale_logits(logits)

    def default(self) -> torch.Tensor:
        """Exactly what the stock model returns.

        Returns:
            The logits ``[b, s, v]`` without labels, else the per-token loss ``[b, s]``.
        """
        logits = self.logits()
        if self.labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as stock
        return self.compute_language_model_loss(self.labels, logits)


class PostprocessProcessor(abc.ABC):
    """Base class for output processors: subclass it and implement :meth:`process`.

    Instances are the callables passed as ``output_processor=``; ``__call__`` takes only keywords,
    builds a :class:`PostprocessContext` and hands it to :meth:`process`. Arguments specific to an
    objective (temperature, masks, ...) belong in the subclass's constructor or in
    ``output_processor_context``, never in ``forward``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "PostprocessProcessor":
        # The hook calls output_processor(**keywords); given the class instead of an instance,
        # that call constructs one: say so instead of "unexpected keyword 'hidden_states'".
        if "hidden_states" in kwargs and "output_layer" in kwargs:
            raise TypeError(
                f"output_processor: got the class {cls.__name__}, expected an instance of it: "
                f"pass output_processor={cls.__name__}(...)"
            )
        return super().__new__(cls)

    def __call__(self, **kwargs: Any) -> Any:
        return self.process(PostprocessContext.from_kwargs(kwargs))

    @property
    def mtp_loss_fn(self) -> Optional[Callable[..., tuple]]:
        """This processor's ``mtp_loss`` in the keyword form a Megatron Core whose
        ``process_mtp_loss`` takes ``mtp_loss_fn`` calls (``upstream/`` patch 0002); None
        without an ``mtp_loss`` (stock MTP)."""
        from .mtp import keyword_mtp_loss_fn, mtp_loss_of

        mtp_loss = mtp_loss_of(self)
        return None if mtp_loss is None else keyword_mtp_loss_fn(mtp_loss)

    @abc.abstractmethod
    def process(self, ctx: PostprocessContext) -> Any:
        """The model's output for this forward.

        Args:
            ctx: this call's keywords and derived facts.

        Returns:
            Whatever the model should return: a tensor, a tuple of tensors (the only forms the
            combined-1F1B schedule plan takes), a dict, or any object.
        """


class DefaultProcessor(PostprocessProcessor):
    """Reproduces the stock output through the hook: logits without labels, the loss with them."""

    def process(self, ctx: PostprocessContext) -> torch.Tensor:
        return ctx.default()


# --------------------------------------------------------------------------- enabling the hook

ModelT = TypeVar("ModelT", bound=Union[torch.nn.Module, list, tuple])


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
    if issubclass(cls, (compat.BackportHookMixin, compat.NativeHookMixin)):
        return cls
    if compat.has_native_hook(cls):
        return compat.native_class(cls)
    return compat.backport_class(cls)


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
    Float16Module wrappers, or a list of such model chunks (virtual pipeline). Only this
    instance's class is switched, to :func:`hooked_class` (never a global patch). Where the class
    already has the hook its calls pass through unchanged, with the MTP loss hook
    (:mod:`mcore_hooks.mtp`) when multi-token prediction is on, and a schedule-plan post-process
    backward that takes only the outputs the loss used. Idempotent.

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
    target = hooked_class(type(inner))
    if target is not type(inner):
        inner.__class__ = target
    return model


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
