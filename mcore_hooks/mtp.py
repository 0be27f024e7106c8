"""Multi-token prediction (MTP) through the processor, with no logits at any depth.

With MTP on, Megatron Core's post-process computes each depth's loss before the main head (and
before the ``output_processor``): it calls the output layer on that depth's hidden states, scales
the logits (MuP), rolls the labels and the loss mask, computes the cross-entropy with
``compute_language_model_loss``, masks it, logs it (0.19: with acceptance counts), scales it by
``mtp_loss_scaling_factor`` over the depths and attaches it to the main hidden states with
``MTPLossAutoScaler``. Only the middle of that needs the logits. This module replaces exactly that
middle with a narrow per-depth callable, :data:`MTPLossFn`, while Megatron keeps the rest, run by
its own code: rolling (``roll_tensor``, packed sequences, CP), scaling, the autoscaler, logging,
``mtp_detach_heads``, labels from ``input_ids`` when labels is None (0.19).

A processor brings its callable as its ``mtp_loss`` attribute (``processor.mtp_loss(depth) ->
MTPLoss``). The bundled fused processors have one: the fused cross-entropy kernel with the
processor's backend and ``chunk_size``, acceptance from the same pass (the label's logit against
the row maximum). A processor without ``mtp_loss`` leaves stock MTP unchanged.

How the callable is reached, per model instance and for one call (nothing global): while the
model's forward (or its schedule plan's post-process node) runs, two instance attributes stand in
for the class's, and are removed afterwards:

* the output layer's ``forward``: for an MTP depth's call (told apart by
  :class:`MTPCalls`) it returns, instead of logits, a :class:`DeferredLogits`
  holding that call's hidden states and weight; the main call is the stock forward. The layer's
  forward pre-hooks still run first (the distributed optimizer's all-gather wait);
* the model's ``compute_language_model_loss``: given a :class:`DeferredLogits` and the rolled
  labels, it calls the MTP callable and returns its per-token loss, which Megatron masks, logs and
  scales as it would its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from . import compat, main_grad
from .kernels import VocabParallel, linear_logprob_entropy

__all__ = ["MTPDepth", "MTPLoss", "MTPLossFn", "DeferredLogits", "fused_mtp_loss", "mtp_loss_of"]


@dataclasses.dataclass(frozen=True)
class MTPDepth:
    """What one MTP depth's loss is computed from.

    Attributes:
        hidden_states: that depth's ``[s, b, h]`` (this rank's ``[s/tp, b, h]`` shard under
            sequence parallelism, CP-local under context parallelism), as Megatron's MTP loss
            has them.
        labels: ``[b, s]``, already rolled for this depth by Megatron (packed-sequence and CP
            aware), derived from ``input_ids`` when the model got no labels (0.19).
        weight: the effective output weight (the embedding's when tied; detached under
            ``mtp_detach_heads``).
        output_layer: the model's output layer.
        logit_scale: the factor on the logits (MuP; 1 without).
        depth: 1 for the first MTP layer, up to ``num_depths``.
        num_depths: the model's ``mtp_num_layers``.
        config: the model's config.
        tp_group: the output layer's tensor-parallel group.
        tp_rank: this rank in it.
        tp_size: its size.
        vocab_start: the global id of this rank's first vocabulary row.
        sequence_parallel: ``hidden_states`` is this rank's token shard.
    """

    hidden_states: torch.Tensor
    labels: torch.Tensor
    weight: torch.Tensor
    output_layer: torch.nn.Module
    logit_scale: float
    depth: int
    num_depths: int
    config: Any
    tp_group: Any
    tp_rank: int
    tp_size: int
    vocab_start: int
    sequence_parallel: bool


class MTPLoss(NamedTuple):
    """What an MTP loss callable returns for one depth.

    Attributes:
        loss: float32 ``[b, s]`` per-token cross-entropy, unmasked (Megatron multiplies it by the
            rolled loss mask, as it does its own).
        accepted: bool ``[b, s]``, whether each label is the depth's most likely token;
            Megatron Core 0.19 counts it over the loss mask and logs ``correct`` / ``total``.
            None where the callable cannot say (then 0.19's training forward raises).
    """

    loss: torch.Tensor
    accepted: Optional[torch.Tensor] = None


MTPLossFn = Callable[[MTPDepth], MTPLoss]


def fused_mtp_loss(
    depth: MTPDepth, *, backend: str = "auto", chunk_size: Optional[int] = None, ignore_index: int = -100,
    batch_invariant: bool = True,
) -> MTPLoss:
    """A depth's loss from the fused kernel: no ``[tokens, vocab]`` logits, acceptance from the
    same pass. No temperature: the MTP loss is a training loss on the raw (MuP-scaled) logits.

    Args:
        depth: the depth's inputs.
        backend: the kernels' backend (see :func:`mcore_hooks.kernels.backend_for`).
        chunk_size: tokens per chunk of the torch backend (None: its default).
        ignore_index: the label of skipped positions.
        batch_invariant: each token's loss the same bits whatever the batch (the default; see
            :func:`~mcore_hooks.kernels.linear_logprob_entropy`).

    Returns:
        The per-token loss and acceptance.
    """
    hidden = depth.hidden_states
    s_local, b, h = hidden.shape
    s = s_local * depth.tp_size if depth.sequence_parallel else s_local
    if depth.labels.shape != (b, s):
        raise ValueError(
            f"labels: expected the MTP depth's labels of shape ({b}, {s}), got {tuple(depth.labels.shape)}"
        )
    # into main_grad as the main head's: DDP skips .grad once the weight is marked
    weight, extra = main_grad.main_grad_route(depth.weight, depth.config)
    r = linear_logprob_entropy(
        hidden.reshape(-1, h), weight, depth.labels.t().reshape(-1),
        logit_scale=depth.logit_scale, ignore_index=ignore_index,
        parallel=VocabParallel(depth.tp_group, depth.vocab_start, depth.sequence_parallel),
        chunk_size=chunk_size, backend=backend, batch_invariant=batch_invariant, **extra,
    )
    return MTPLoss((-r.logprob).view(s, b).t(), r.label_is_argmax.view(s, b).t())


def keyword_mtp_loss_fn(mtp_loss: MTPLossFn) -> Callable[..., tuple]:
    """``mtp_loss`` in the keyword form of ``upstream/0002-process-mtp-loss-callable.patch``
    (``process_mtp_loss(mtp_loss_fn=...)``): called with the depth's ``hidden_states``, rolled
    ``labels`` and ``loss_mask``, ``output_layer``, ``output_weight``, ``scale_logits_fn``,
    ``depth`` and ``config``, it returns ``(loss, correct, total)``, the counts over the mask."""

    def mtp_loss_fn(*, hidden_states: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                    output_layer: Any, output_weight: Optional[torch.Tensor],
                    scale_logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]], depth: int,
                    config: Any, **_: Any) -> tuple:
        weight = output_layer.weight if output_weight is None else output_weight
        layout = compat.vocab_layout(output_layer, weight)
        scale = 1.0 if scale_logits_fn is None else compat.logit_scale(scale_logits_fn, config)
        result = mtp_loss(MTPDepth(
            hidden_states=hidden_states, labels=labels, weight=weight, output_layer=output_layer,
            logit_scale=scale, depth=depth, num_depths=int(config.mtp_num_layers), config=config,
            tp_group=layout.group, tp_rank=layout.rank, tp_size=layout.size,
            vocab_start=layout.vocab_start, sequence_parallel=layout.sequence_parallel,
        ))
        counted = loss_mask.bool()
        if result.accepted is None:
            raise TypeError("mtp_loss: Megatron Core's MTP logging needs MTPLoss.accepted")
        return result.loss, (result.accepted & counted).sum().float(), counted.sum().float()

    return mtp_loss_fn


def mtp_loss_of(output_processor: Any) -> Optional[MTPLossFn]:
    """The processor's MTP callable.

    Args:
        output_processor: the processor passed to the model (or None).

    Returns:
        Its ``mtp_loss`` attribute, or None (stock MTP).

    Raises:
        TypeError: ``mtp_loss`` is there but not callable.
    """
    fn = getattr(output_processor, "mtp_loss", None)
    if fn is not None and not callable(fn):
        raise TypeError(
            f"output_processor.mtp_loss: expected a callable (MTPDepth) -> MTPLoss, got "
            f"{type(fn).__name__}"
        )
    return fn


class DeferredLogits:
    """Stands in for one MTP depth's logits ``[s, b, V/tp]``: the hidden states and weight they
    would be computed from, never the logits themselves.

    It takes exactly what Megatron Core's MTP code does with those logits, and nothing else (any
    other use raises a TypeError naming it): ``logits * scale`` (MuP output scaling, 0.17+);
    ``compute_language_model_loss(labels, logits)`` (the model's stand-in calls the MTP
    callable); and, in 0.19's acceptance counting, ``torch.argmax(logits, dim=-1)`` or, for
    vocab-sharded logits, ``logits.size(-1)`` and ``logits.max(dim=-1)``. Those answer from the
    callable's ``accepted``: the label where it is the most likely token, another id where it is
    not, which is all Megatron compares them with.
    """

    def __init__(self, hidden_states: torch.Tensor, weight: torch.Tensor, output_layer: Any,
                 depth: int, model: Any, scale: float = 1.0) -> None:
        self.hidden_states, self.weight, self.output_layer = hidden_states, weight, output_layer
        self.depth, self.model, self.scale = depth, model, scale
        self.labels: Optional[torch.Tensor] = None
        self.accepted: Optional[torch.Tensor] = None

    # --- MuP scaling
    def __mul__(self, other: Any) -> "DeferredLogits":
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented
        out = DeferredLogits(self.hidden_states, self.weight, self.output_layer, self.depth,
                             self.model, self.scale * float(other))
        return out

    __rmul__ = __mul__

    # --- the loss
    def loss(self, labels: torch.Tensor, mtp_loss: MTPLossFn) -> torch.Tensor:
        layout = compat.vocab_layout(self.output_layer, self.weight)
        result = mtp_loss(MTPDepth(
            hidden_states=self.hidden_states, labels=labels, weight=self.weight,
            output_layer=self.output_layer,
            logit_scale=self.scale,  # Megatron's MuP scaling reached us as `logits * scale`
            depth=self.depth, num_depths=int(self.model.config.mtp_num_layers),
            config=self.model.config, tp_group=layout.group, tp_rank=layout.rank,
            tp_size=layout.size, vocab_start=layout.vocab_start,
            sequence_parallel=layout.sequence_parallel,
        ))
        if not isinstance(result, MTPLoss):
            raise TypeError(f"mtp_loss: expected an MTPLoss (loss, accepted), got {type(result).__name__}")
        self.labels, self.accepted = labels, result.accepted
        return result.loss

    # --- 0.19's acceptance counting
    def _predictions(self) -> torch.Tensor:
        """``[s, b]`` ids whose comparison with the labels is the callable's acceptance."""
        if self.accepted is None or self.labels is None:
            raise TypeError(
                "Megatron Core's MTP acceptance counting asked for this depth's predictions, but "
                "the MTP loss callable returned no acceptance (MTPLoss.accepted)"
            )
        vocab = self.size(-1) * compat.vocab_layout(self.output_layer, self.weight).size
        labels = self.labels.t()
        return torch.where(self.accepted.t(), labels, (labels + 1) % vocab)

    def size(self, dim: Optional[int] = None) -> Any:
        if dim in (-1, 2):
            return self.weight.shape[0]
        raise TypeError(f"size({dim}) of an MTP depth's stand-in logits: only size(-1) is known")

    def max(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, local ids)`` whose vocab-parallel argmax over the TP group is
        :meth:`_predictions`: value 1 on the rank owning the id, 0 elsewhere."""
        if dim not in (-1, 2):
            raise TypeError(f"max(dim={dim}) of an MTP depth's stand-in logits: only dim=-1")
        layout = compat.vocab_layout(self.output_layer, self.weight)
        local = self._predictions() - layout.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        return owned.float(), torch.where(owned, local, 0)

    @classmethod
    def __torch_function__(cls, func: Any, types_: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.argmax and args and isinstance(args[0], cls):
            if kwargs.get("dim", args[1] if len(args) > 1 else None) not in (-1, 2):
                raise TypeError("torch.argmax of an MTP depth's stand-in logits: only dim=-1")
            return args[0]._predictions()
        raise TypeError(
            f"{getattr(func, '__name__', func)} on an MTP depth's stand-in logits: mcore-hooks "
            "computes the MTP loss without logits and supports only what Megatron Core's MTP "
            "code does with them (scaling, the loss, 0.19's acceptance); this Megatron Core "
            "does more, so the fused MTP loss cannot run on it"
        )


_ABSENT = object()
_LABELS_GIVEN: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("mcore_hooks_labels_given", default=None)


def labels_given() -> Optional[bool]:
    """Inside an MTP loss: whether the model's forward got ``labels`` (False: Megatron derived
    the depths' labels from ``input_ids``, 0.19+); None where not known."""
    return _LABELS_GIVEN.get()


@contextlib.contextmanager
def mtp_loss_hook(model: Any, mtp_loss: Optional[MTPLossFn], calls: "MTPCalls",
                  labels: Any = _ABSENT) -> Iterator[None]:
    """Within the block, the model's MTP depths compute their loss with ``mtp_loss`` (see the
    module docstring); a no-op when ``mtp_loss`` is None. Restored on exit. ``labels``: the
    forward's, for :func:`labels_given`."""
    if mtp_loss is None or not calls.num_depths:
        yield
        return
    token = _LABELS_GIVEN.set(None if labels is _ABSENT else labels is not None)
    layer = model.output_layer
    stock_forward = layer.forward
    stock_loss = model.compute_language_model_loss
    saved = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name in
             ((layer, "forward"), (model, "compute_language_model_loss"))]

    def forward(input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None, **kwargs: Any) -> Any:
        depth = calls.depth(input_)
        if not depth:
            return stock_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs)
        compat.refuse_deferred_embedding_wgrad(layer)
        if kwargs:
            raise TypeError(
                f"an MTP depth's output-layer call passed {sorted(kwargs)}, which the fused MTP "
                "loss does not handle on this Megatron Core"
            )
        return DeferredLogits(input_, layer.weight if weight is None else weight, layer, depth, model), None

    def compute_language_model_loss(self: Any, labels: torch.Tensor, logits: Any) -> torch.Tensor:
        if isinstance(logits, DeferredLogits):
            return logits.loss(labels, mtp_loss)
        return stock_loss(labels, logits)

    layer.forward = forward
    # A bound method of the model, like the one it replaces (processors find the model by it).
    model.compute_language_model_loss = types.MethodType(compute_language_model_loss, model)
    try:
        with main_grad.shared_routes():  # the depths and the main head: one main_grad hand-off
            yield
    finally:
        _LABELS_GIVEN.reset(token)
        for obj, name, original in saved:
            if original is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


class MTPCalls:
    """Which of one forward's output-layer calls compute a multi-token-prediction depth's logits.

    With MTP on, the stock post-process calls the output layer once per MTP depth before the
    main call. How to tell them apart depends on the release, found by feature detection:

    * 0.14+: the MTP block returns the main and the depths' hidden states concatenated along the
      sequence, and the post-process takes them apart with ``torch.chunk``: a depth call's input is
      chunk ``d >= 1`` of that concatenation (a view of it), the main call's is chunk 0 (or no
      view, when the MTP step did not run);
    * 0.13: ``MultiTokenPredictionBlock.forward`` calls the output layer itself, once per depth: a
      call made while the block runs is the next depth's (told by forward hooks on the block,
      registered for the scope of this object's ``with``).

    Use it as a context manager around the forward (or post-process) it classifies.
    """

    def __init__(self, model: Any) -> None:
        self.num_depths = int(getattr(model.config, "mtp_num_layers", None) or 0)
        block = getattr(model, "mtp", None) if self.num_depths else None
        self._block = block if block is not None and compat.forward_accepts(type(block), "output_layer") else None
        self._inside = False
        self._depth = 0
        self._last: Optional[tuple[torch.Tensor, int]] = None  # a call may be asked about twice
        self._handles: list[Any] = []

    def __enter__(self) -> "MTPCalls":
        if self._block is not None:
            def enter(*_: Any) -> None:
                self._inside, self._depth = True, 0

            def leave(*_: Any) -> None:
                self._inside = False

            self._handles = [
                self._block.register_forward_pre_hook(enter),
                self._block.register_forward_hook(leave),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def depth(self, hidden_states: torch.Tensor) -> int:
        """The MTP depth (1-based) an output-layer call with this input computes; 0 for the main
        call."""
        if not self.num_depths:
            return 0
        if self._block is not None:
            if not self._inside:
                return 0
            if self._last is None or self._last[0] is not hidden_states:
                self._depth += 1
                self._last = (hidden_states, self._depth)
            return self._last[1]
        base = hidden_states._base
        s = hidden_states.shape[0]
        if (
            base is None
            or base.dim() != hidden_states.dim()
            or base.shape[1:] != hidden_states.shape[1:]
            or base.shape[0] != (1 + self.num_depths) * s
            or not hidden_states.is_contiguous()
        ):
            return 0
        offset = hidden_states.storage_offset() - base.storage_offset()
        return offset // hidden_states[:1].numel() // s


def native_mtp_loss(model: Any, output_processor: Any) -> Any:
    """The processor's MTP loss where the native class needs the stand-ins for it (MTP on, and a
    ``process_mtp_loss`` that takes no per-depth callable); None otherwise."""
    if output_processor is None or not compat.mtp_enabled(model) or compat.native_mtp_loss_fn():
        return None
    return mtp_loss_of(output_processor)
