"""Tiny stock Megatron Core language models and batches for CPU tests.

:func:`build_tiny_model` builds the *stock* ``GPTModel`` / ``HybridModel`` / ``MambaModel`` (or a
subclass with the same constructor) on CPU, from the stock local (non-Transformer-Engine) layer
recipe with only the CUDA-only pieces swapped for the stand-ins of :mod:`.shims`. Weights
depend only on ``TinyModelConfig.seed`` (and not on the tensor-parallel size: with
``use_cpu_initialization`` every TP shard is a slice of the same master weight).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..compat import MODEL_CLASSES, model_class
from .shims import CpuCoreAttention, CpuNorm, cpu_shims, te_norm_replaced

__all__ = [
    "TinyModelConfig",
    "available_model_classes",
    "stock_model_class",
    "supports_packed_sequences",
    "build_tiny_model",
    "tiny_batch",
    "packed_sequence_slices",
]


@dataclass(frozen=True)
class TinyModelConfig:
    """What :func:`build_tiny_model` builds. Small enough for CPU tests that take milliseconds."""

    model_class: str = "gpt"  # "gpt", "hybrid" (HybridModel, 0.18+), "mamba" (MambaModel)
    tied: bool = True  # share_embeddings_and_output_weights
    sequence_parallel: bool = False
    pre_process: bool = True
    post_process: bool = True
    vocab_size: int = 96  # must be divisible by the TP size (no vocab padding is done)
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    max_sequence_length: int = 32
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    mtp_num_layers: int = 0  # multi-token prediction depths (GPTModel; HybridModel 0.18+; 0: off)
    mtp_detach_heads: bool = False  # Megatron Core 0.19+

    def splits_over(self, tp: int) -> bool:
        """Whether the vocabulary and the attention heads split evenly over ``tp`` ranks (no
        vocabulary padding is done)."""
        return self.vocab_size % tp == 0 and self.num_attention_heads % tp == 0


def available_model_classes() -> tuple[str, ...]:
    """Which of ``"gpt"``, ``"hybrid"``, ``"mamba"`` the installed Megatron Core provides."""
    return tuple(name for name in MODEL_CLASSES if model_class(name) is not None)


def stock_model_class(name: str) -> type:
    """The stock Megatron Core class for ``"gpt"``, ``"hybrid"`` or ``"mamba"``."""
    if name not in MODEL_CLASSES:
        raise ValueError(f"unknown model class {name!r}; expected one of {tuple(MODEL_CLASSES)}")
    cls = model_class(name)
    if cls is None:
        module_name, class_name = MODEL_CLASSES[name]
        raise NotImplementedError(
            f"the installed Megatron Core has no {module_name}.{class_name} "
            f"(available: {available_model_classes()})"
        )
    return cls


def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def supports_packed_sequences(name: str) -> bool:
    """Whether the stock ``forward`` of this class accepts ``packed_seq_params`` (THD batches).

    ``MambaModel.forward`` on Megatron Core 0.13 does not.
    """
    return "packed_seq_params" in _forward_params(stock_model_class(name))


def _init_params(cls: type) -> frozenset[str]:
    """Constructor keywords of ``cls``, following ``**kwargs`` forwarding up the MRO (0.18+
    ``MambaModel.__init__(*args, mamba_stack_spec=None, **kwargs)`` forwards to HybridModel)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(
            n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return frozenset(names)


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------
def _local_layer_submodules() -> Any:
    """The stock local (non-TE) GPT layer recipe with the CUDA-only pieces swapped.

    Swapped: core attention (DotProductAttention -> CpuCoreAttention) and both norms
    (WrappedTorchNorm/FusedLayerNorm -> CpuNorm, which also works with sequence parallel).
    Everything else (SelfAttention, ColumnParallelLinear, RowParallelLinear, MLP, bias-dropout-add)
    is the version's own choice.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    sub = spec.submodules
    sub.input_layernorm = CpuNorm
    sub.pre_mlp_layernorm = CpuNorm
    sub.self_attention.submodules.core_attention = CpuCoreAttention
    return spec


def _gpt_block_spec(cfg: TinyModelConfig) -> Any:
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = _local_layer_submodules()
    # Given as block submodules so the final norm is CpuNorm too (from a layer spec,
    # TransformerBlock would pick the module-level WrappedTorchNorm, which refuses SP).
    return TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=CpuNorm)


def _mtp_block_spec(config: Any) -> Any:
    """The stock local MTP block spec around the CPU layer recipe, its norms (which the local
    provider makes WrappedTorchNorm, refusing sequence parallel) swapped for CpuNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    block = get_gpt_mtp_block_spec(config, _local_layer_submodules(), use_transformer_engine=False)
    layers = []
    for spec in block.layer_specs:
        spec = copy.deepcopy(spec)
        for norm in ("enorm", "hnorm", "layer_norm"):
            if hasattr(spec.submodules, norm):
                setattr(spec.submodules, norm, CpuNorm)
        layers.append(spec)
    block.layer_specs = layers
    return block


def _hybrid_stack() -> tuple[type, type]:
    """(stack class, submodules class): HybridStack from 0.18 (MambaModel uses it too), else
    MambaStack."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules

        return HybridStack, HybridStackSubmodules
    except ImportError:
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return MambaStack, MambaStackSubmodules


def _hybrid_stack_spec(mtp: bool = False) -> Any:
    """Hybrid/Mamba stack spec with attention ('*') and MLP ('-') layers only.

    Mamba layers ('M') need CUDA-only packages (mamba_ssm, causal_conv1d), so they are left as the
    stack's default (never built: the pattern has no 'M'). The stock stack specs fuse the norms into
    TE linears; here the layers carry their own CpuNorm (same maths, different parameter names).
    """
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    stack_cls, submodules_cls = _hybrid_stack()
    local = _local_layer_submodules()
    attention_layer = ModuleSpec(
        module=local.module,
        submodules=TransformerLayerSubmodules(
            input_layernorm=CpuNorm,
            self_attention=local.submodules.self_attention,
            self_attn_bda=local.submodules.self_attn_bda,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=CpuNorm,
            mlp=local.submodules.mlp,
            mlp_bda=local.submodules.mlp_bda,
        ),
    )
    submodules = submodules_cls(attention_layer=attention_layer, mlp_layer=mlp_layer)
    if mtp and hasattr(submodules, "mtp_block_spec"):
        submodules.mtp_block_spec = _hybrid_mtp_block_spec()
    return ModuleSpec(module=stack_cls, submodules=submodules)


def _hybrid_mtp_block_spec() -> Any:
    """HybridModel's MTP block (0.18+): norms and projection here, the inner layers built from the
    MTP part of the pattern; upstream's recipe with TE swapped for CpuNorm / ColumnParallelLinear."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=CpuNorm, hnorm=CpuNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
            layer_norm=CpuNorm,
        ),
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]),
    )


def _hybrid_pattern(num_layers: int, mtp_depths: int = 0) -> str:
    # Alternate attention and MLP layers, like a transformer: "*-*-..."; each MTP depth is one
    # attention and one MLP layer ("main/mtp/mtp", 0.18+).
    return ("*-" * num_layers)[:num_layers] + "/*-" * mtp_depths


# --------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------
def _transformer_config(cfg: TinyModelConfig, tp: int) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        # Weights made on CPU as slices of one master weight: TP-size independent, no CUDA.
        use_cpu_initialization=True,
        # Deterministic results (and no RNG use in forward).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=cfg.params_dtype,
        bf16=cfg.params_dtype == torch.bfloat16,
        fp16=cfg.params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        sequence_parallel=cfg.sequence_parallel,
    )
    if cfg.params_dtype != torch.float32:
        kwargs["pipeline_dtype"] = cfg.params_dtype
    if cfg.mtp_num_layers:
        # mtp_loss_scaling_factor has no default before 0.16
        kwargs.update(mtp_num_layers=cfg.mtp_num_layers, mtp_loss_scaling_factor=0.1)
        if cfg.mtp_detach_heads:
            kwargs["mtp_detach_heads"] = True  # 0.19+: TypeError on older releases
    return TransformerConfig(**kwargs)


def _ensure_rng_tracker_seeded(seed: int) -> None:
    # The helpers in .distributed seed the tracker; seed it here if the caller set up parallel
    # state by other means (stock code forks it in SP forward and Mamba init).
    from megatron.core import tensor_parallel

    if "model-parallel-rng" not in tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_tiny_model(cfg: TinyModelConfig, model_cls: Optional[type] = None) -> torch.nn.Module:
    """Build a tiny stock Megatron Core model on CPU (Megatron parallel state must exist).

    ``model_cls`` defaults to ``stock_model_class(cfg.model_class)``; a subclass with the same
    constructor gets exactly the same weights for the same ``cfg.seed`` (torch is seeded right
    before construction). The model uses learned absolute position embeddings (RoPE moves
    ``inv_freq`` to CUDA), no dropout, ``params_dtype`` parameters, ``parallel_output=True``.
    Hybrid/Mamba models get attention and MLP layers only (pattern ``"*-*-..."``).

    The model is built inside a :func:`~mcore_hooks.testing.cpu_shims` scope. Its forward needs
    one too at TP > 1 or with sequence parallel (Megatron's mappings allocate on the CUDA device
    and fork the CUDA RNG tracker): :func:`~mcore_hooks.testing.model_parallel` and
    :func:`~mcore_hooks.testing.run_on_ranks` run their body in one.

    Raises ``NotImplementedError`` for what cannot run on CPU: context or pipeline parallelism,
    and model classes the installed Megatron Core lacks; ``ValueError`` for sequence parallel at
    TP=1 or sizes not divisible by the TP size.
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron model parallel state is not initialised: build inside "
            "mcore_hooks.testing.model_parallel() or a function run by run_on_ranks()"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise NotImplementedError("build_tiny_model does not build pipeline-parallel stages")
    if parallel_state.get_context_parallel_world_size() != 1:
        raise NotImplementedError(
            "context parallelism needs TEDotProductAttention (Transformer Engine, CUDA); the CPU "
            "core attention does not implement it"
        )
    if not cfg.splits_over(tp):
        raise ValueError(
            f"vocab_size={cfg.vocab_size} and num_attention_heads={cfg.num_attention_heads} "
            f"must be divisible by the tensor-parallel size {tp}"
        )
    if cfg.sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tensor parallelism (Megatron Core rejects TP=1)")
    if model_cls is None:
        model_cls = stock_model_class(cfg.model_class)
    with cpu_shims():  # stock construction forks the RNG tracker (Mamba init, <= 0.17)
        _ensure_rng_tracker_seeded(cfg.seed)
        return _cast(_construct(cfg, model_cls, _transformer_config(cfg, tp)), cfg)


def _construct(cfg: TinyModelConfig, model_cls: type, config: Any) -> torch.nn.Module:
    common: dict[str, Any] = dict(
        config=config,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length,
        pre_process=cfg.pre_process,
        post_process=cfg.post_process,
        share_embeddings_and_output_weights=cfg.tied,
        position_embedding_type="learned_absolute",
    )
    if cfg.model_class == "gpt":
        if cfg.mtp_num_layers:
            common["mtp_block_spec"] = _mtp_block_spec(config)
        torch.manual_seed(cfg.seed)
        return model_cls(transformer_layer_spec=_gpt_block_spec(cfg), **common)
    if cfg.mtp_num_layers and "hybrid_layer_pattern" not in _init_params(model_cls):
        raise NotImplementedError(
            "multi-token prediction on HybridModel/MambaModel needs Megatron Core 0.18+ "
            "(the hybrid layer pattern's MTP part)"
        )

    params = _init_params(model_cls)
    # Keyword names changed across versions: the stack spec is mamba_stack_spec (<= 0.17) or
    # hybrid_stack_spec (0.18+; MambaModel still accepts the deprecated mamba_stack_spec), the
    # layer pattern hybrid_override_pattern (<= 0.16) or hybrid_layer_pattern (0.17+).
    spec_kw = "hybrid_stack_spec" if "hybrid_stack_spec" in params else "mamba_stack_spec"
    pattern_kw = (
        "hybrid_layer_pattern" if "hybrid_layer_pattern" in params else "hybrid_override_pattern"
    )
    stack_spec = _hybrid_stack_spec(mtp=bool(cfg.mtp_num_layers))
    common[spec_kw] = stack_spec
    common[pattern_kw] = _hybrid_pattern(cfg.num_layers, cfg.mtp_num_layers)
    # The stack builds its final norm with TENorm whatever the spec says: swap it for CpuNorm
    # only while constructing.
    with te_norm_replaced(stack_spec.module.__module__):
        torch.manual_seed(cfg.seed)
        return model_cls(**common)


def _cast(model: torch.nn.Module, cfg: TinyModelConfig) -> torch.nn.Module:
    # Megatron leaves some parameters in fp32 whatever params_dtype says (e.g. the learned
    # position embeddings) and relies on Float16Module's module.bfloat16()/half() to cast the
    # rest; do that cast here, without the wrapper, so the model stays the stock class.
    if cfg.params_dtype != torch.float32:
        model.to(dtype=cfg.params_dtype)
    return model


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------
def _packed_lengths(
    num_sequences: int, seq_length: int, max_length: int, gen: torch.Generator
) -> list[int]:
    """Different lengths around ``seq_length`` summing to ``num_sequences * seq_length`` (so the
    pack divides by the TP size whenever ``seq_length`` does), each in [1, max_length]."""
    lengths = [seq_length] * num_sequences
    spread = min(seq_length - 1, max_length - seq_length)
    for i in range(0, num_sequences - 1, 2):
        if spread > 0:
            delta = int(torch.randint(1, spread + 1, (1,), generator=gen))
            lengths[i] -= delta
            lengths[i + 1] += delta
    return lengths


def _tokens_and_labels(n: int, length: int, vocab: int, gen: torch.Generator):
    tokens = torch.randint(0, vocab, (n, length + 1), generator=gen, dtype=torch.int64)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss_mask(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Ones with a few zeros (~15 %, at least one) so masking is exercised.
    mask = (torch.rand(shape, generator=gen) >= 0.15).float()
    if bool(mask.all()):
        mask.view(-1)[int(torch.randint(0, mask.numel(), (1,), generator=gen))] = 0.0
    return mask


def tiny_batch(
    cfg: TinyModelConfig,
    *,
    batch_size: int = 2,
    seq_length: int = 16,
    packed: bool = False,
    seed: int = 0,
    with_labels: bool = True,
) -> dict:
    """Keyword arguments for ``model.forward`` of a :func:`build_tiny_model` model.

    Unpacked: ``input_ids`` ``[b, s]`` int64, ``position_ids`` ``[b, s]``, ``attention_mask`` the
    boolean causal mask ``[b, 1, s, s]`` (True = masked: no CUDA mask gets built).

    ``packed=True``: a THD batch as RL frameworks pass it: ``batch_size`` sequences of different
    lengths (summing to ``batch_size * seq_length``) in ``input_ids`` ``[1, T]``, ``position_ids``
    restarting at 0 per sequence, ``packed_seq_params`` a ``PackedSeqParams(qkv_format='thd',
    cu_seqlens_q/kv (int32), max_seqlen_q/kv)`` and ``attention_mask=None`` (the CPU core attention
    derives the per-sequence causal mask from ``packed_seq_params``). Raises
    ``NotImplementedError`` where the stock ``forward`` has no ``packed_seq_params``.

    ``with_labels``: ``labels`` (the next token of each sequence) and, where the stock ``forward``
    accepts it, ``loss_mask`` (float ones with a few zeros).

    Sequence parallel needs ``seq_length`` divisible by the TP size.
    """
    model_cls = stock_model_class(cfg.model_class)
    forward_params = _forward_params(model_cls)
    if seq_length > cfg.max_sequence_length:
        raise ValueError(f"seq_length={seq_length} > max_sequence_length={cfg.max_sequence_length}")
    gen = torch.Generator().manual_seed(seed)
    batch: dict[str, Any] = {}
    if not packed:
        input_ids, labels = _tokens_and_labels(batch_size, seq_length, cfg.vocab_size, gen)
        batch["input_ids"] = input_ids
        batch["position_ids"] = torch.arange(seq_length).repeat(batch_size, 1)
        causal = torch.ones(seq_length, seq_length, dtype=torch.bool).triu(1)
        batch["attention_mask"] = causal.expand(batch_size, 1, seq_length, seq_length).clone()
    else:
        if "packed_seq_params" not in forward_params:
            raise NotImplementedError(
                f"{model_cls.__name__}.forward of this Megatron Core version has no "
                "packed_seq_params: packed (THD) batches are not supported"
            )
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = _packed_lengths(batch_size, seq_length, cfg.max_sequence_length, gen)
        pieces = [_tokens_and_labels(1, n, cfg.vocab_size, gen) for n in lengths]
        input_ids = torch.cat([p[0] for p in pieces], dim=1)
        labels = torch.cat([p[1] for p in pieces], dim=1)
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        batch["input_ids"] = input_ids
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        batch["attention_mask"] = None
        batch["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens.clone(),
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
    if with_labels:
        batch["labels"] = labels
        if "loss_mask" in forward_params:
            batch["loss_mask"] = _loss_mask(tuple(labels.shape), gen)
    return batch


def packed_sequence_slices(batch: dict) -> list[slice]:
    """Token slices of each sequence of a packed :func:`tiny_batch` (along dim 1 of its tensors)."""
    cu = batch["packed_seq_params"].cu_seqlens_q.tolist()
    return [slice(a, b) for a, b in zip(cu[:-1], cu[1:])]

