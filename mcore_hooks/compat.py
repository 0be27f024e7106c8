"""What the installed Megatron Core release has, and its release-specific call shapes: a leaf.

Found by feature detection (does a class exist, does a ``forward`` take a keyword), never by
version strings, and importing no other module of this package. What lives here:

* discovery of the language-model classes the hook is delivered for (GPTModel, HybridModel,
  MambaModel) and of whether a class already has upstream's hook (Megatron Core >= 0.18 GPTModel);
* Megatron's process groups and output-layer layout (rank and size, the CP group, the vocab
  split), its MuP logit scale, and running an output layer's forward pre-hooks as torch would;
* what the schedules give the loss (:func:`schedule_loss_gradient`), which releases take a
  per-depth MTP loss callable, where inference keeps its last-token flag.

The hooked classes built on these facts are assembled in :mod:`mcore_hooks.hooked`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import types
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

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
    """Whether the Megatron Core class ``cls`` derives from (the first in its MRO defined in
    ``megatron``) already takes upstream's ``output_processor`` keyword in ``forward``."""
    stock = next((c for c in cls.__mro__ if c.__module__.startswith("megatron.")), cls)
    return forward_accepts(stock, "output_processor")


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


# Megatron's get_pg_rank / get_pg_size, looked up once outside torch.compile (an lru_cache in
# traced code makes Dynamo warn of possible silent incorrectness); [] until then, [None] without.
_PG_HELPERS: list = []


def _megatron_pg_helpers() -> Optional[tuple[Callable[[Any], int], Callable[[Any], int]]]:
    if not _PG_HELPERS and not torch.compiler.is_compiling():
        try:
            from megatron.core.utils import get_pg_rank, get_pg_size
        except ImportError:
            _PG_HELPERS.append(None)
        else:
            _PG_HELPERS.append((get_pg_rank, get_pg_size))
    return _PG_HELPERS[0] if _PG_HELPERS else None


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


def schedule_loss_gradient(config: Any, num_microbatches: int, *, loss_func_returns: int = 2) -> float:
    """The gradient Megatron Core's schedules give the loss a ``loss_func`` returns (every release
    0.13-0.20, ``forward_step`` / ``forward_step_calc_loss`` then ``backward_step``).

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


def _is_stock_scale_logits(fn: Any) -> bool:
    """Whether ``fn`` is Megatron's own ``LanguageModule._scale_logits`` (0.17+), told by where
    it is defined: no import and no cache, so ``torch.compile`` traces it as plain attribute
    reads (an ``lru_cache`` in traced code made Dynamo warn of possible silent incorrectness)."""
    return (getattr(fn, "__qualname__", None) == "LanguageModule._scale_logits"
            and getattr(fn, "__module__", None) == "megatron.core.models.common.language_module.language_module")


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
    if _is_stock_scale_logits(getattr(scale_logits, "__func__", None)):
        return float(config.mup_output_mult) if getattr(config, "use_mup", False) else 1.0
    probe = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = scale_logits(probe)
    if out is probe:
        return 1.0
    scale = float(out[0])
    if not math.isclose(float(out[1]), 2.0 * scale, rel_tol=1e-12):
        raise ValueError("scale_logits: the model's logit scaling is not a constant factor")
    return scale


@functools.lru_cache(maxsize=None)
def mtp_derives_labels() -> bool:
    """Whether Megatron Core's MTP derives the depths' labels from ``input_ids`` when the model
    gets none (``process_mtp_loss(input_ids=...)``, 0.19+); before, MTP needs labels."""
    try:
        from megatron.core.transformer import multi_token_prediction as mtp
    except ImportError:
        return False
    f = getattr(mtp, "process_mtp_loss", None)
    return f is not None and "input_ids" in inspect.signature(f).parameters


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


