"""The ``output_processor`` protocol: the keywords, the check, the context and the processor base class.

The call convention is Megatron Core's own (>= 0.18, ``GPTModel.forward(..., output_processor=,
output_processor_context=)``): after the decoder (and the MTP step) the last pipeline stage calls
``output_processor(**OUTPUT_PROCESSOR_KEYWORDS)`` instead of its output layer and returns what the
processor returns. :func:`enable_output_processor` makes the same call happen on every supported
release and class (:mod:`mcore_hooks.hooked`); code written against this module runs unchanged on
stock Megatron Core >= 0.18 GPTModel.

Contract (documented and tested): the processor never runs on non-last pipeline stages (they return
hidden states); ``hidden_states`` are ``[s, b, h]``, ``[s/tp, b, h]`` when sequence parallel is on,
and context-parallel local under CP; a processor that ignores a keyword must still accept it.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Any, Callable, Mapping, Optional

import torch

from . import compat
from .mtp import keyword_mtp_loss_fn, mtp_loss_of

__all__ = [
    "OUTPUT_PROCESSOR_KEYWORDS",
    "PostprocessContext",
    "PostprocessProcessor",
    "DefaultProcessor",
    "check_output_processor",
]

# Upstream's keyword set (Megatron Core >= 0.18, ``GPTModel._postprocess``), in upstream's order.
OUTPUT_PROCESSOR_KEYWORDS: tuple[str, ...] = (
    "hidden_states",
    "output_layer",
    "output_weight",
    "labels",
    "loss_mask",
    "input_ids",
    "position_ids",
    "attention_mask",
    "decoder_input",
    "inference_context",
    "packed_seq_params",
    "runtime_gather_output",
    "context",
    "compute_language_model_loss",
    "scale_logits",
    "config",
)


def check_output_processor(processor: Any) -> None:
    """Check that ``processor`` can be called with upstream's keywords.

    A processor must accept all 16 keywords by name (or ``**kwargs``, which also keeps it forward
    compatible with keywords a later Megatron Core may add) and require no other argument.

    Args:
        processor: the would-be ``output_processor``.

    Raises:
        TypeError: naming ``output_processor``: a class instead of an instance, not callable, a
            keyword it cannot take, or an argument the hook never passes.
    """
    if isinstance(processor, type):
        raise TypeError(
            f"output_processor: got the class {processor.__name__}, expected an instance of it: "
            f"pass output_processor={processor.__name__}(...)"
        )
    if not callable(processor):
        raise TypeError(
            f"output_processor: expected a callable taking Megatron Core's output_processor "
            f"keywords, got {type(processor).__name__}"
        )
    target = processor
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        missing: list[str] = []
    else:
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [k for k in OUTPUT_PROCESSOR_KEYWORDS if k not in named]
    required = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in OUTPUT_PROCESSOR_KEYWORDS
    ]
    if missing or required:
        why = []
        if missing:
            why.append(f"does not accept the keyword(s) {', '.join(missing)}")
        if required:
            why.append(f"requires argument(s) the hook never passes: {', '.join(required)}")
        raise TypeError(
            f"output_processor {processor!r} {'; '.join(why)}. A processor is called with the "
            f"keywords {', '.join(OUTPUT_PROCESSOR_KEYWORDS)}; take `**kwargs` to accept them all."
        )



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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The hook passes keywords only; *args is here to say so instead of Python's bare
        # "__call__() takes 1 positional argument but 3 were given".
        if args or not kwargs:
            name = type(self).__name__
            got = f"{len(args)} positional argument(s)" if args else "no arguments"
            raise TypeError(
                f"{name} is an output processor: pass it to the model, "
                f"model(..., output_processor={name}(...)), which calls it with Megatron Core's "
                f"output_processor keywords ({', '.join(OUTPUT_PROCESSOR_KEYWORDS[:3])}, ...); "
                f"called directly it takes those keywords only, got {got}"
            )
        return self.process(PostprocessContext.from_kwargs(kwargs))

    @property
    def mtp_loss_fn(self) -> Optional[Callable[..., tuple]]:
        """This processor's ``mtp_loss`` in the keyword form a Megatron Core whose
        ``process_mtp_loss`` takes ``mtp_loss_fn`` calls (``upstream/`` patch 0002); None
        without an ``mtp_loss`` (stock MTP)."""
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
