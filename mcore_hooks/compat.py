"""Everything that depends on which Megatron Core release is installed, in one place.

Found by feature detection (does a class exist, does a ``forward`` take a keyword), never by
version strings. What lives here:

* discovery of the language-model classes the hook is delivered for (GPTModel, HybridModel,
  MambaModel) and of whether a class already has upstream's hook (Megatron Core >= 0.18 GPTModel);
* Megatron's process groups and output-layer layout (rank and size, the CP group, the vocab
  split), its MuP logit scale, and running an output layer's forward pre-hooks as torch would;
* upstream's call convention: the 16 keywords a processor is called with, and the check that a
  processor can take them;
* which output-layer calls are multi-token-prediction depths (:class:`MTPCalls`);
* :class:`BackportHookMixin`, which delivers that exact call on classes without the hook (in
  ``forward`` and ``build_schedule_plan``), and :class:`NativeHookMixin`, which passes a native
  class's calls through, adding the MTP loss hook (:mod:`mcore_hooks.mtp`) with MTP on and a
  plan post-process backward that tolerates outputs the loss did not use.

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
(:func:`output_layer_inputs`: the distributed optimizer's all-gather wait), as upstream's do.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import math
import types
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

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


# --------------------------------------------------------------------------- class discovery


# Short name -> (module, class): the language-model classes the hook is delivered for. "mamba" is
# MambaModel in every release (a deprecated HybridModel subclass from 0.18); "hybrid" is 0.18+.
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "gpt": ("megatron.core.models.gpt.gpt_model", "GPTModel"),
    "hybrid": ("megatron.core.models.hybrid.hybrid_model", "HybridModel"),
    "mamba": ("megatron.core.models.mamba.mamba_model", "MambaModel"),
}


@functools.lru_cache(maxsize=None)
def model_class(name: str) -> Optional[type]:
    """The installed release's class for a :data:`MODEL_CLASSES` short name, or None."""
    module_name, class_name = MODEL_CLASSES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, class_name, None)


@functools.lru_cache(maxsize=None)
def language_model_classes() -> dict[str, type]:
    """The supported Megatron Core language-model classes that the installed release has, by name."""
    found = {MODEL_CLASSES[short][1]: model_class(short) for short in MODEL_CLASSES}
    return {name: cls for name, cls in found.items() if cls is not None}


def is_language_model_class(cls: type) -> bool:
    """Whether ``cls`` is (a subclass of) a supported Megatron Core language model."""
    return isinstance(cls, type) and issubclass(cls, tuple(language_model_classes().values()))


def forward_accepts(cls: type, keyword: str) -> bool:
    """Whether ``cls.forward`` takes ``keyword`` by name (not merely through ``**kwargs``)."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(keyword)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def has_native_hook(cls: type) -> bool:
    """Whether stock ``cls.forward`` already takes upstream's ``output_processor`` keyword."""
    return (
        not issubclass(cls, (BackportHookMixin, NativeHookMixin))
        and forward_accepts(cls, "output_processor")
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The language model inside DDP / Float16Module / torch DDP wrappers (they all hold ``.module``).

    Raises TypeError naming the argument when no supported language model is found.
    """
    inner: Any = model
    seen = 0
    while not is_language_model_class(type(inner)):
        nxt = getattr(inner, "module", None)
        if not isinstance(nxt, torch.nn.Module) or seen > 16:
            names = ", ".join(language_model_classes()) or "none found"
            raise TypeError(
                f"model: expected a Megatron Core language model ({names}) or a wrapper holding "
                f"one in `.module` (DistributedDataParallel, Float16Module), got "
                f"{type(model).__name__}"
            )
        inner, seen = nxt, seen + 1
    return inner


# --------------------------------------------------------------------------- process groups


@functools.lru_cache(maxsize=None)
def _megatron_pg_helpers() -> Optional[tuple[Callable[[Any], int], Callable[[Any], int]]]:
    try:
        from megatron.core.utils import get_pg_rank, get_pg_size
    except ImportError:
        return None
    return get_pg_rank, get_pg_size


def group_rank_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and its size; ``(0, 1)`` for None (not split) or without
    torch.distributed. Megatron's ``get_pg_rank`` / ``get_pg_size`` where the release has them."""
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 0, 1
    helpers = _megatron_pg_helpers()
    if helpers is not None:
        return helpers[0](group), helpers[1](group)
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


class VocabLayout(NamedTuple):
    """How an output layer's weight and input are split over its tensor-parallel group."""

    group: Any
    rank: int
    size: int
    vocab_start: int  # global id of this rank's first vocabulary row
    sequence_parallel: bool  # the input is this rank's token shard


def vocab_layout(output_layer: Any, weight: torch.Tensor) -> VocabLayout:
    """The layout of Megatron's ``ColumnParallelLinear`` output layer: its ``tp_group``, every rank
    holding ``padded_vocab / tp`` rows, sequence parallel as the layer says (only with TP > 1)."""
    group = getattr(output_layer, "tp_group", None)
    rank, size = group_rank_size(group)
    sp = bool(getattr(output_layer, "sequence_parallel", False)) and size > 1
    return VocabLayout(group, rank, size, rank * weight.shape[0], sp)


def model_of_hook_call(compute_language_model_loss: Any) -> Any:
    """The model that called the processor: the hook passes its bound ``compute_language_model_loss``
    (None when the caller passed something else)."""
    return getattr(compute_language_model_loss, "__self__", None)


def context_parallel_group(compute_language_model_loss: Any, config: Any) -> Any:
    """The model's context-parallel group: ``LanguageModule.cp_group`` (its process-group
    collection's, 0.14+). Where the model has none (0.13, or a processor called by hand) and the
    config asks for CP, Megatron's global one; None without CP."""
    group = getattr(model_of_hook_call(compute_language_model_loss), "cp_group", None)
    if group is not None:
        return group
    if getattr(config, "context_parallel_size", 1) <= 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


# --------------------------------------------------------------------------- output-layer inputs


def run_forward_pre_hooks(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Run ``module``'s forward pre-hooks exactly as ``module(*args, **kwargs)`` runs them before
    its ``forward`` (torch's ``Module._call_impl``): global hooks, then the module's, each with or
    without kwargs as registered; a hook's return value replaces the arguments. Returns the
    ``(args, kwargs)`` the forward would receive."""
    from torch.nn.modules import module as nn_module

    global_hooks = getattr(nn_module, "_global_forward_pre_hooks", {})
    with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in (*global_hooks.items(), *module._forward_pre_hooks.items()):
        if hook_id in with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        "forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                        f"but got {result}."
                    )
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def refuse_deferred_embedding_wgrad(output_layer: Any) -> None:
    """Refuse, before anything runs, to bypass an output layer that defers its weight gradient.

    With ``defer_embedding_wgrad_compute`` (pipeline parallelism with gradient-accumulation
    fusion) the output layer's forward stores its input in ``embedding_activation_buffer`` and
    its backward the ``[tokens, V/tp]`` logit gradient, and the schedule's flush drains both into
    ``main_grad``. A processor that reads the weight itself never runs the layer, so the flush
    pops from an empty buffer; filling it would take the logits-sized gradient these processors
    exist to avoid."""
    config = getattr(output_layer, "config", None)
    if (
        getattr(config, "defer_embedding_wgrad_compute", False)
        and getattr(output_layer, "embedding_activation_buffer", None) is not None
        and torch.is_grad_enabled()
    ):
        raise ValueError(
            "defer_embedding_wgrad_compute: the output layer defers its weight gradient to the "
            "pipeline flush (embedding_activation_buffer), which a processor reading the weight "
            "itself never fills; turn defer_embedding_wgrad_compute off (the fused processors "
            "add the weight's gradient into main_grad themselves), or use a processor that calls "
            "the output layer (ctx.logits())"
        )


def output_layer_precision_note(config: Any) -> Optional[str]:
    """Where the stock output layer computes its logits in another precision than the bf16/fp16
    weight times the hidden states (what a processor reading the weight computes, in float32):
    Megatron Core 0.19's MXFP8 LM head (``fp8_output_proj`` with ``fp8`` and the ``mxfp8``
    recipe). None otherwise. (``logit_dtype=float32``, on Megatron-LM's main branch, makes stock
    compute what the processors compute: float32 logits from the same inputs.)"""
    if not (getattr(config, "fp8_output_proj", False) and getattr(config, "fp8", False)):
        return None
    recipe = getattr(config, "fp8_recipe", None)
    if "mxfp8" not in str(getattr(recipe, "value", recipe)).lower():
        return None
    return (
        "fp8_output_proj: the model's output layer runs an MXFP8 GEMM (Megatron Core's MXFP8 LM "
        "head); the processor reads the weight and computes the logits from the bf16 weight and "
        "hidden states in float32, so its values are not stock's: they differ by MXFP8's rounding"
    )


def output_layer_inputs(
    output_layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    output_weight: Optional[torch.Tensor],
    runtime_gather_output: Optional[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, weight)`` as the output layer's ``forward`` would receive them.

    The stock model calls ``output_layer(hidden_states, weight=output_weight,
    runtime_gather_output=...)``; its forward pre-hooks run first (Megatron DDP's wait for the
    distributed optimizer's overlapped parameter all-gather, Megatron-FSDP's unshard) and may
    replace the arguments. A processor that reads the weight instead of calling the layer must see
    the same, so this runs them (once: the processor is called before the layer's hooks, natively
    and on the backport). The weight is ``output_weight`` (tied embeddings) or the layer's own,
    read after the hooks.
    """
    refuse_deferred_embedding_wgrad(output_layer)
    args: tuple = (hidden_states,)
    kwargs: dict = {"weight": output_weight, "runtime_gather_output": runtime_gather_output}
    args, kwargs = run_forward_pre_hooks(output_layer, args, kwargs)
    hidden = args[0] if args else kwargs["input_"]
    weight = kwargs.get("weight")
    return hidden, (output_layer.weight if weight is None else weight)


# --------------------------------------------------------------------------- logit scaling


def main_grad_accumulator(weight: torch.Tensor, config: Any) -> Optional[torch.Tensor]:
    """Megatron's float32 ``main_grad`` of the output weight, where the weight's gradient is to go
    straight into it: the config asks for ``gradient_accumulation_fusion`` (Megatron's own linear
    layers then add their weight gradient there), the weight has a float32 ``main_grad`` and
    needs a gradient. None otherwise, and under Megatron-FSDP (whose ``main_grad`` buffers are
    made on demand): the gradient then goes to ``.grad`` and DDP adds it, as for any layer."""
    if not (getattr(config, "gradient_accumulation_fusion", False) and torch.is_grad_enabled()):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if (not weight.requires_grad or hasattr(weight, "__fsdp_param__")
            or not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32):
        return None
    return main_grad


class _MainGradHandoff(torch.autograd.Function):
    """Megatron's protocol for a weight gradient added straight into ``main_grad``, as its
    ``LinearWithGradAccumulationAndAsyncCommunication`` follows it: once the kernels' backward
    has accumulated (they feed this node, and hand it no gradient), mark
    ``grad_added_to_main_grad`` and hand autograd a placeholder, zeros where ``zero_out_wgrad``
    (a weight tied to the embedding on this stage, whose real gradient is added to the same
    ``.grad``), so DDP's hook runs and adds nothing twice. Without DDP's attribute: no
    gradient, as Megatron's layers return none.

    The placeholder is ``[V/tp, h]`` in the weight's dtype, as Megatron's layers allocate theirs:
    DDP's hook asserts a ``.grad`` under ``overlap_grad_reduce``, and autograd stores a gradient
    that does not have the weight's strides as a dense copy (a zero-stride one would be copied
    to full size anyway). One node serves every call that routes the weight before its backward
    runs (the main head and each MTP depth), so one placeholder is made per backward, not one per
    call for autograd to sum."""

    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.set_materialize_grads(False)  # the kernels hand this node nothing: run without zeros
        ctx.weight, ctx.main_grad, ctx.ran = weight, main_grad, False
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.ran = True
        weight = ctx.weight
        if grad is not None:  # from an op other than the kernels that used the routed weight
            ctx.main_grad.add_(grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None, None
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.shape, dtype=weight.dtype, device=weight.device), None


# id(weight) -> (the weight, its routed view), both weakly: the view lives as long as the graph
# that uses it, so a dead entry means its graph is gone
_ROUTES: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _routed(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """``weight`` through the hand-off: the pending node of an earlier call when its backward has
    not run yet (one placeholder per backward), else a new one."""
    if torch.compiler.is_compiling():  # Dynamo traces no weak references: one node per call
        return _MainGradHandoff.apply(weight, main_grad)
    entry = _ROUTES.get(id(weight))
    if entry is not None:
        same, routed = entry[0]() is weight, entry[1]()
        if same and routed is not None and not routed.grad_fn.ran and routed.grad_fn.main_grad is main_grad:
            return routed
    routed = _MainGradHandoff.apply(weight, main_grad)
    for key in [k for k, (w, r) in _ROUTES.items() if w() is None or r() is None]:
        del _ROUTES[key]
    _ROUTES[id(weight)] = (weakref.ref(weight), weakref.ref(routed))
    return routed


def main_grad_route(weight: torch.Tensor, config: Any) -> tuple[torch.Tensor, dict]:
    """``(weight, kernel keywords)``: where :func:`main_grad_accumulator` gives a buffer, the
    weight through the hand-off (whose placeholder reaches the parameter as Megatron's layers
    hand theirs over) and the keywords that make a kernel add into the buffer; else the weight
    and no keywords."""
    main_grad = main_grad_accumulator(weight, config)
    if main_grad is None:
        return weight, {}
    return _routed(weight, main_grad), dict(weight_grad_accumulator=main_grad)


def schedule_loss_gradient(config: Any, num_microbatches: int, *, loss_func_returns: int = 2) -> float:
    """The gradient Megatron Core's schedules give the loss a ``loss_func`` returns (every release
    0.13-0.19, ``forward_step`` / ``forward_step_calc_loss`` then ``backward_step``).

    The last stage's backward seed is ``S = grad_scale_func(1)`` (the optimizer's loss scale: 1
    for bf16 and fp32 without ``loss_scale``), and the loss is scaled in place first:

    * ``(loss, logging)``: ``loss * cp_size / num_microbatches`` -> ``S * cp / M``;
    * ``(loss, num_tokens, logging)`` with ``calculate_per_token_loss``: unscaled -> ``S`` (the
      token count divides ``main_grad`` later, uniformly, in ``finalize_model_grads``);
    * ``(loss, num_tokens, logging)`` without it: ``loss / num_tokens / M``, a data-dependent
      gradient that cannot be declared in advance.

    Data-parallel averaging acts on ``main_grad`` as a whole after the backward, so it does not
    enter. The value is computed in float32 in the schedule's order, so it is the gradient bit
    for bit. Reading the optimizer's scale waits for the device: call it once per step. Raises
    ValueError for what cannot be declared (the data-dependent case, fp16's moving loss scale)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches: expected a positive int, got {num_microbatches!r}")
    if loss_func_returns not in (2, 3):
        raise ValueError(f"loss_func_returns: expected 2 or 3 (the length of loss_func's tuple), got {loss_func_returns!r}")
    if getattr(config, "fp16", False):
        raise ValueError(
            "upstream_grad: fp16's dynamic loss scale moves from step to step, so the gradient "
            "cannot be declared in advance; leave upstream_grad None"
        )
    scale_func = getattr(config, "grad_scale_func", None)
    # the optimizer's scale lives on the device: reading it waits for it (once per call)
    seed = torch.ones((), dtype=torch.float32)
    if scale_func is not None:
        seed = scale_func(seed).detach().float().cpu().reshape(())
    if loss_func_returns == 3:
        if not getattr(config, "calculate_per_token_loss", False):
            raise ValueError(
                "upstream_grad: a loss_func returning (loss, num_tokens, logging) without "
                "calculate_per_token_loss has its loss divided by num_tokens, a data-dependent "
                "gradient that cannot be declared; return (loss, logging), or set "
                "calculate_per_token_loss, or leave upstream_grad None"
            )
        return float(seed)
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    # the backward of the schedule's in-place `loss *= cp; loss /= M` under the seed, in float32
    # and in its order: an exact declaration, compared with == in the kernels' backward
    return float(seed / num_microbatches * cp)


@functools.lru_cache(maxsize=None)
def _stock_scale_logits() -> Optional[Callable[..., Any]]:
    try:
        from megatron.core.models.common.language_module.language_module import LanguageModule
    except ImportError:
        return None
    return getattr(LanguageModule, "_scale_logits", None)


def identity_scale_logits(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """``scale_logits`` on releases whose stock forward applies no MuP output scaling (< 0.17),
    bound to the model as upstream's ``_scale_logits`` is (:func:`scale_logits_of`)."""
    return logits


def scale_logits_of(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``scale_logits`` a hook call passes: the model's bound ``_scale_logits``, as upstream
    passes it (0.17+, applied in every stock forward the backport serves: GPTModel 0.17,
    MambaModel 0.17+, HybridModel). Releases without it scale nothing; they get an identity
    bound to the model all the same, so ``scale_logits.__self__`` is the model on every release,
    as a processor written against upstream's hook may rely on."""
    bound = getattr(model, "_scale_logits", None)
    return bound if bound is not None else types.MethodType(identity_scale_logits, model)


def logit_scale(scale_logits: Callable[[torch.Tensor], torch.Tensor], config: Any) -> float:
    """The constant factor ``scale_logits`` applies to the logits.

    Megatron's own (``LanguageModule._scale_logits``, 0.17+) multiplies by
    ``config.mup_output_mult`` when ``config.use_mup``: read from the config. Any other callable
    is probed once on a float64 pair; ValueError if it is not a constant factor.
    """
    if getattr(scale_logits, "__func__", None) is identity_scale_logits:
        return 1.0
    stock = _stock_scale_logits()
    if stock is not None and getattr(scale_logits, "__func__", None) is stock:
        return float(config.mup_output_mult) if getattr(config, "use_mup", False) else 1.0
    probe = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = scale_logits(probe)
    if out is probe:
        return 1.0
    scale = float(out[0])
    if not math.isclose(float(out[1]), 2.0 * scale, rel_tol=1e-12):
        raise ValueError("scale_logits: the model's logit scaling is not a constant factor")
    return scale


# --------------------------------------------------------------------------- the call convention


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


def mtp_enabled(model: torch.nn.Module) -> bool:
    return bool(getattr(model.config, "mtp_num_layers", None))


@functools.lru_cache(maxsize=None)
def native_mtp_loss_fn() -> bool:
    """Whether Megatron Core's ``process_mtp_loss`` takes a per-depth ``mtp_loss_fn`` itself (and
    the models pass the processor's): then the processor's MTP loss needs no stand-ins."""
    try:
        from megatron.core.transformer.multi_token_prediction import process_mtp_loss
    except ImportError:
        return False
    return "mtp_loss_fn" in inspect.signature(process_mtp_loss).parameters


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
        self._block = block if block is not None and forward_accepts(type(block), "output_layer") else None
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


@contextlib.contextmanager
def full_sequence_logits(inference_context: Any) -> Iterator[None]:
    """Keep stock inference code from slicing hidden states to the last token before the hook.

    Upstream calls the processor before that slicing; the backport intercepts at the output layer,
    after it, so it switches the context's flag off for the call. The flag sits on the context
    before 0.17 and on ``context.config`` from 0.17.
    """
    holder = None
    for obj in (inference_context, getattr(inference_context, "config", None)):
        if obj is not None and getattr(obj, "materialize_only_last_token_logits", False) is True:
            holder = obj
            break
    if holder is None:
        yield
        return
    holder.materialize_only_last_token_logits = False
    try:
        yield
    finally:
        holder.materialize_only_last_token_logits = True


# --------------------------------------------------------------------------- the backport

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
    mtp_calls: "MTPCalls",
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
                scale_logits=scale_logits_of(model),
                config=model.config,
            )

        def run() -> Any:
            with full_sequence_logits(inference_context):
                return stock_forward(*args, **kwargs)

        if not getattr(model, "post_process", False):
            return run()  # not the last pipeline stage: hidden states, processor never runs
        from .mtp import mtp_loss_hook, mtp_loss_of

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
        from .schedule_plan import attach_processor

        return attach_processor(self, plan, output_processor, output_processor_context)


def no_schedule_plan_reason(cls: type) -> str:
    """Why ``cls`` has no ``build_schedule_plan`` on the installed Megatron Core."""
    gpt = model_class("gpt")
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
        from .mtp import mtp_loss_hook, mtp_loss_of

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
        from .schedule_plan import attach_native

        stock = getattr(super(), "build_schedule_plan", None)
        if stock is None:  # a native hook without a plan (HybridModel with upstream/0001)
            raise NotImplementedError(no_schedule_plan_reason(type(self)))
        if output_processor is not None:
            check_output_processor(output_processor)
        plan = stock(  # type: ignore[misc]
            *args, output_processor=output_processor,
            output_processor_context=output_processor_context, **kwargs
        )
        return attach_native(self, plan, output_processor)


def native_mtp_loss(model: Any, output_processor: Any) -> Any:
    """The processor's MTP loss where the native class needs the stand-ins for it (MTP on, and a
    ``process_mtp_loss`` that takes no per-depth callable); None otherwise."""
    from .mtp import mtp_loss_of

    if output_processor is None or not mtp_enabled(model) or native_mtp_loss_fn():
        return None
    return mtp_loss_of(output_processor)


def _hooked_subclass(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front, named ``Hooked<cls>``: same constructor and state dict."""
    name = cls.__name__ if cls.__name__.startswith("Hooked") else f"Hooked{cls.__name__}"
    return type(
        name,
        (mixin, cls),
        {"__module__": "mcore_hooks.postprocess", "__qualname__": name, "__doc__": cls.__doc__},
    )


@functools.lru_cache(maxsize=None)
def native_class(cls: type) -> type:
    """``cls`` (with upstream's hook) with :class:`NativeHookMixin` in front, once per ``cls``."""
    return _hooked_subclass(NativeHookMixin, cls)


@functools.lru_cache(maxsize=None)
def backport_class(cls: type) -> type:
    """``cls`` with :class:`BackportHookMixin` in front, once per ``cls``."""
    return _hooked_subclass(BackportHookMixin, cls)
