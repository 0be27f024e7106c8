"""Test-only CPU stand-ins for the CUDA-only pieces of Megatron Core.

This is the ONE module holding them. Production code never imports it: the stand-ins exist so
that the *stock* Megatron Core model code (GPTModel, HybridModel, MambaModel, tensor-parallel
layers and mappings) runs unchanged on a CPU-only machine, with gloo for tensor parallelism.

What stands in for what (each class/function below says why in its docstring):

- :class:`CpuCoreAttention` -> ``DotProductAttention`` / ``TEDotProductAttention``
  (the former allocates its score buffer on ``torch.cuda.current_device()``, builds its default
  causal mask on CUDA and rejects packed sequences; the latter needs Transformer Engine).
- :class:`CpuNorm` -> ``WrappedTorchNorm`` / ``FusedLayerNorm`` / ``TENorm``
  (``WrappedTorchNorm`` refuses sequence parallel, the others need Apex / Transformer Engine).
- :func:`te_norm_replaced` -> the ``TENorm`` that ``MambaStack`` / ``HybridStack`` hard-code for
  their final norm (applied only while a test builder constructs such a model).
- :class:`CpuRNGStatesTracker` -> ``CudaRNGStatesTracker`` (its ``fork()``/``add()`` read and
  write the CUDA generator state, which fails without a GPU).
- :func:`schedule_plan_on_cpu` -> the CUDA streams, events and NVTX ranges of Megatron's
  combined-1F1B schedule plan (applied only inside its own scope, by the schedule-plan tests).
- :func:`_no_inference_linear` -> Megatron Core 0.20's ``is_inference_column_parallel_linear``
  as the MTP layer sees it: without Transformer Engine its two classes are ``MagicMock`` stand-ins,
  not types, and the ``isinstance`` check fails inside ``MultiTokenPredictionLayer.__init__``.
- the ``torch`` proxy :func:`cpu_shims` puts in a few Megatron modules -> the ``torch.cuda.current_device()``
  calls with which Megatron's tensor-parallel mappings, linear layers and global memory buffer
  allocate their communication buffers (only those Megatron modules see the proxy; everything
  else, including production code under test, still sees the real ``torch.cuda``).

Nothing is patched at import time, and nothing outlives a :func:`cpu_shims` scope: it applies the
patches on entry and puts every patched attribute back on exit. The test builders
(:func:`~mcore_hooks.testing.model_parallel`, :func:`~mcore_hooks.testing.build_tiny_model`) and
``mcore_hooks.verify`` work inside such a scope.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from typing import Any, Iterator, Optional

import torch

__all__ = [
    "CpuCoreAttention",
    "CpuNorm",
    "CpuRNGStatesTracker",
    "cpu_shims",
    "cpu_shims_installed",
    "schedule_plan_on_cpu",
    "te_norm_replaced",
]


# --------------------------------------------------------------------------------------------
# Core attention
# --------------------------------------------------------------------------------------------
def _megatron_module_base() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class CpuCoreAttention(_megatron_module_base()):  # type: ignore[misc]
    """CPU stand-in for ``DotProductAttention`` / ``TEDotProductAttention`` in a layer spec.

    Why: stock ``DotProductAttention`` takes its score buffer from Megatron's global memory buffer
    (allocated on ``torch.cuda.current_device()``), builds its default causal mask on CUDA when
    ``attention_mask`` is None, and asserts ``packed_seq_params is None``; the TE variant needs
    Transformer Engine. This module computes the same math in fp32 with plain matmul + softmax:

    - the boolean ``attention_mask`` Megatron passes (True = masked) is honoured as given; when it
      is None and the mask type is causal, a causal mask is built on the input's device;
    - for packed THD input (``packed_seq_params.qkv_format == 'thd'``) tokens attend only within
      their own packed sequence (boundaries from ``cu_seqlens_q_padded`` when set, else
      ``cu_seqlens_q``; tokens past a sequence's unpadded length are neither attended to nor
      produce output), causally when the mask type is causal;
    - extra keyword arguments that differ between Megatron Core versions (``pg_collection``,
      ``model_comm_pgs``, ``cp_comm_type``, ...) are accepted and ignored.

    Input/output layouts are those of the stock modules: ``[s, b, np, hn]`` in, ``[s, b, np*hn]``
    out; for THD ``[t, np, hn]`` in, ``[t, np*hn]`` out.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int = 1,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError(
                "CpuCoreAttention does not implement context parallelism (stock Megatron Core "
                "only supports it in TEDotProductAttention, which needs CUDA)."
            )
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("CpuCoreAttention does not implement sliding windows.")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("CpuCoreAttention only implements the vanilla softmax.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back in fp32 before the softmax: a no-op for an fp32 softmax, so not modelled.
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def _is_causal(self, attn_mask_type: Any) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return mask_type is not None and "causal" in getattr(mask_type, "name", str(mask_type))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """q, k, v: [b, np, s, hn] fp32; mask: bool ~ [b, np, sq, sk], True = masked."""
        scale = self.softmax_scale
        if scale is None:
            scale = 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            # finfo.min rather than -inf: a fully masked row gives a uniform row, never NaN
            # (matches Megatron's masked-fill-then-softmax behaviour).
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.dropout_p > 0:
            probs = self._dropout(probs)
        return torch.matmul(probs, v)

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        # Same RNG discipline as DotProductAttention: forked tracker state unless sequence
        # parallel (then the caller's region is already forked).
        if self.config.sequence_parallel:
            return torch.nn.functional.dropout(probs, self.dropout_p, training=True)
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(probs, self.dropout_p, training=True)

    @staticmethod
    def _expand_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
        # Grouped-query attention: repeat key/value heads to match the query heads.
        rep = q.size(head_dim) // k.size(head_dim)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=head_dim)
            v = v.repeat_interleave(rep, dim=head_dim)
        return k, v

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("CpuCoreAttention does not implement attention_bias.")
        causal = self._is_causal(attn_mask_type)
        if getattr(packed_seq_params, "qkv_format", None) == "thd":
            return self._forward_thd(query, key, value, attention_mask, packed_seq_params, causal)

        # [s, b, np, hn] -> [b, np, s, hn] in fp32.
        key, value = self._expand_groups(query, key, value, head_dim=2)
        q = query.permute(1, 2, 0, 3).float()
        k = key.permute(1, 2, 0, 3).float()
        v = value.permute(1, 2, 0, 3).float()
        sq, sk = q.size(2), k.size(2)
        mask = attention_mask
        if mask is not None:
            mask = mask.to(device=q.device, dtype=torch.bool)
        elif causal and sq > 1:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1 + sk - sq)
        ctx = self._attend(q, k, v, mask)  # [b, np, sq, hn]
        sq, b, np_, hn = ctx.size(2), ctx.size(0), ctx.size(1), ctx.size(3)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn).to(query.dtype)

    def _forward_thd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        params: Any,
        causal: bool,
    ) -> torch.Tensor:
        # query/key/value: [t, np, hn] (SelfAttention squeezed the dummy batch dim).
        t = query.size(0)
        device = query.device
        cu = params.cu_seqlens_q
        cu_padded = getattr(params, "cu_seqlens_q_padded", None)
        starts_src = cu_padded if cu_padded is not None else cu
        starts = starts_src.to(device=device, dtype=torch.long)
        lengths = (cu[1:] - cu[:-1]).to(device=device, dtype=torch.long)
        pos = torch.arange(t, device=device)
        # Segment id per token (-1 past the last boundary); offset within its segment.
        seg = torch.bucketize(pos, starts[1:], right=True)
        seg = torch.where(pos < starts[-1], seg, torch.full_like(seg, -1))
        seg_c = seg.clamp(min=0)
        offset = pos - starts[seg_c]
        valid = (seg >= 0) & (offset < lengths[seg_c])
        allowed = (seg[:, None] == seg[None, :]) & valid[:, None] & valid[None, :]
        if causal:
            allowed = allowed & (pos[None, :] <= pos[:, None])
        mask = ~allowed  # [t, t], True = masked
        if attention_mask is not None:
            extra = attention_mask.to(device=device, dtype=torch.bool)
            mask = mask | extra.reshape(extra.shape[-2:])
        key, value = self._expand_groups(query, key, value, head_dim=1)
        q = query.permute(1, 0, 2).unsqueeze(0).float()  # [1, np, t, hn]
        k = key.permute(1, 0, 2).unsqueeze(0).float()
        v = value.permute(1, 0, 2).unsqueeze(0).float()
        ctx = self._attend(q, k, v, mask)[0]  # [np, t, hn]
        ctx = ctx * valid[None, :, None]  # padding tokens produce zeros, as TE does
        return ctx.permute(1, 0, 2).reshape(t, -1).to(query.dtype)


# --------------------------------------------------------------------------------------------
# Norm
# --------------------------------------------------------------------------------------------
class CpuNorm:
    """Torch norm with Megatron's norm constructor signature ``(config, hidden_size, eps)``.

    Stands in for ``WrappedTorchNorm`` / ``FusedLayerNorm`` (local specs) and ``TENorm`` (TE specs
    and the final norm of ``MambaStack``/``HybridStack``). Why: ``WrappedTorchNorm`` asserts
    ``not config.sequence_parallel``; ``FusedLayerNorm`` needs Apex and ``TENorm`` needs Transformer
    Engine. Like Megatron's fused norms, it marks its parameters ``sequence_parallel`` when
    ``config.sequence_parallel`` so their gradients are all-reduced across the TP group by
    Megatron's grad finalisation. Returns a plain ``torch.nn.LayerNorm``/``RMSNorm`` (so state-dict
    keys are ``weight``/``bias`` as with ``WrappedTorchNorm``) in ``config.params_dtype``.
    """

    def __new__(  # type: ignore[misc]
        cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any
    ) -> torch.nn.Module:
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("CpuNorm does not implement zero-centered gamma.")
        normalization = getattr(config, "normalization", "LayerNorm")
        dtype = getattr(config, "params_dtype", torch.float32)
        if normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        elif normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=dtype)
        else:
            raise NotImplementedError(f"CpuNorm does not implement normalization={normalization!r}")
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        for param in norm.parameters():
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm


@contextlib.contextmanager
def te_norm_replaced(*module_names: str) -> Iterator[None]:
    """Within the block, the named modules' global ``TENorm`` is :class:`CpuNorm`.

    Stands in for Transformer Engine's ``TENorm``, which ``MambaStack`` (``megatron.core.ssm.
    mamba_block``) and ``HybridStack`` (``megatron.core.models.hybrid.hybrid_block``, 0.18+)
    hard-code for their final norm whatever the stack spec says. Why a scoped patch: the stack
    looks the name up in its own module at construction time, and nothing else should see the
    swap, so it is undone as soon as the test builder has constructed the model.
    """
    saved: list[tuple[types.ModuleType, Any]] = []
    try:
        for name in module_names:
            module = sys.modules.get(name) or importlib.import_module(name)
            if hasattr(module, "TENorm"):
                saved.append((module, module.TENorm))
                module.TENorm = CpuNorm
        yield
    finally:
        for module, original in reversed(saved):
            module.TENorm = original


# --------------------------------------------------------------------------------------------
# RNG tracker
# --------------------------------------------------------------------------------------------
def _cuda_tracker_base() -> type:
    from megatron.core.tensor_parallel import random as mcore_random

    # The original class even inside a cpu_shims() scope, which rebinds the module attribute.
    return _ORIGINAL.get("CudaRNGStatesTracker", mcore_random.CudaRNGStatesTracker)


_ORIGINAL: dict[str, Any] = {}


class CpuRNGStatesTracker(_cuda_tracker_base()):  # type: ignore[misc]
    """CPU stand-in for Megatron's ``CudaRNGStatesTracker``.

    Why: stock ``add()`` and ``fork()`` save and restore the CUDA generator
    (``torch.cuda.get_rng_state`` / ``_set_cuda_rng_state``), which fails without a GPU, and stock
    forward code forks the tracker under sequence parallel (embedding dropout, TransformerBlock)
    and in attention dropout; ``MambaStack`` (<= 0.17) forks it while initialising weights. On a
    CPU model the device generator *is* the CPU generator, so this tracker keeps the same named,
    separately seeded streams (``model-parallel-rng`` etc., seeded exactly as
    ``model_parallel_cuda_manual_seed`` asks) and ``fork()`` swaps the default CPU generator's
    state in and out. Bookkeeping (``seeds_``, ``states_``, errors) is the stock one.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception("seed {} already exists".format(seed))
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception("cuda rng state {} already exists".format(name))
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig_state)


# --------------------------------------------------------------------------------------------
# Device redirection for Megatron's tensor-parallel buffers
# --------------------------------------------------------------------------------------------
class _CudaOnCpu:
    """``torch.cuda`` whose ``current_device()`` is the CPU; everything else is the real one.

    Exception: once this process has initialised CUDA (a model was moved to a GPU), the real
    current device is returned, so CUDA models keep the stock behaviour. CPU-only test processes
    never initialise CUDA, even on a GPU machine (``torch.cuda.is_available()`` does not).
    """

    @staticmethod
    def current_device() -> Any:
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithCpuDevice(types.ModuleType):
    """``torch`` seen by the Megatron modules below: real torch, but ``torch.cuda.current_device()``
    is the CPU, so their ``torch.empty(..., device=torch.cuda.current_device())`` buffers are CPU
    tensors like their inputs."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# Megatron modules whose buffers are allocated with torch.cuda.current_device() on the CPU-test
# path: TP/SP mappings (gather/reduce-scatter outputs), the linear layers' SP all-gather/reduce-
# scatter in forward/backward, TP split/gather helpers, the global memory buffer, and the MTP
# loss's logging tracker.
_DEVICE_REDIRECTED_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.utils",
    # MTPLossLoggingHelper's tracker (0.14+) and roll_tensor's CP buffers
    "megatron.core.transformer.multi_token_prediction",
)

_DEPTH = 0  # nesting depth of cpu_shims() scopes in this process


def cpu_shims_installed() -> bool:
    """Whether this process is inside a :func:`cpu_shims` scope."""
    return _DEPTH > 0


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Within the block, Megatron Core's CUDA-only pieces have their CPU stand-ins.

    - ``torch`` in the Megatron modules listed in ``_DEVICE_REDIRECTED_MODULES`` is a proxy whose
      ``cuda.current_device()`` is the CPU (stands in for the CUDA allocation device);
    - Megatron's RNG tracker is a :class:`CpuRNGStatesTracker` (stands in for
      ``CudaRNGStatesTracker``): the class name ``initialize_rng_tracker`` instantiates is rebound
      and an already created stock tracker is set aside for an empty CPU one, which
      ``model_parallel_cuda_manual_seed`` (or the test builders) seed.

    Re-entrant: nested scopes share the outermost one's patches. On leaving the outermost scope
    every patched attribute is the original object again (the stock tracker too, with its
    states). The attention/norm stand-ins are not patches: builders put them into layer specs.
    """
    global _DEPTH
    if _DEPTH == 0:
        _install()
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            _uninstall()


def _no_inference_linear(module: Any) -> bool:
    """Stands in for Megatron Core 0.20's ``is_inference_column_parallel_linear`` in its MTP
    module, where that function's classes are not types (Transformer Engine absent): no layer is
    an inference linear then, as none can be built without Transformer Engine."""
    return False


def _inference_linear_check_broken() -> Optional[types.ModuleType]:
    """The MTP module whose ``is_inference_column_parallel_linear`` raises for every module (0.20
    without Transformer Engine), or None."""
    mtp = sys.modules.get("megatron.core.transformer.multi_token_prediction")
    if mtp is None:
        try:
            mtp = importlib.import_module("megatron.core.transformer.multi_token_prediction")
        except ImportError:
            return None
    check = getattr(mtp, "is_inference_column_parallel_linear", None)
    if check is None:
        return None
    try:
        check(None)
    except TypeError:
        return mtp
    return None


def _install() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    proxy = _TorchWithCpuDevice()
    for name in _DEVICE_REDIRECTED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            _ORIGINAL[f"torch@{name}"] = module.torch
            module.torch = proxy
    mtp = _inference_linear_check_broken()
    if mtp is not None:
        _ORIGINAL["is_inference_column_parallel_linear"] = (mtp, mtp.is_inference_column_parallel_linear)
        mtp.is_inference_column_parallel_linear = _no_inference_linear
    _ORIGINAL["CudaRNGStatesTracker"] = mcore_random.CudaRNGStatesTracker
    _ORIGINAL["tracker"] = (
        mcore_random._CUDA_RNG_STATE_TRACKER,
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        # A stock tracker already exists (its states, if any, are CUDA states): set it aside for
        # an empty CPU one, seeded by model_parallel_cuda_manual_seed or the test builders.
        mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _uninstall() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    for name in _DEVICE_REDIRECTED_MODULES:
        key = f"torch@{name}"
        if key in _ORIGINAL:
            sys.modules[name].torch = _ORIGINAL.pop(key)
    if "is_inference_column_parallel_linear" in _ORIGINAL:
        mtp, check = _ORIGINAL.pop("is_inference_column_parallel_linear")
        mtp.is_inference_column_parallel_linear = check
    mcore_random.CudaRNGStatesTracker = _ORIGINAL.pop("CudaRNGStatesTracker")
    # The tracker as it was before the scope, whatever the scope created or seeded.
    (
        mcore_random._CUDA_RNG_STATE_TRACKER,
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    ) = _ORIGINAL.pop("tracker")


# --------------------------------------------------------------------------------------------
# Streams and events of the combined-1F1B schedule plan
# --------------------------------------------------------------------------------------------
class _NoEvent:
    """Stands in for ``torch.cuda.Event``: on one CPU stream every event has already happened."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def schedule_plan_on_cpu() -> Iterator[None]:
    """Within the block, the CUDA calls of Megatron's combined-1F1B schedule plan do nothing.

    Why: the plan (``TransformerModelChunkSchedulePlan``, its ``ScheduleNode`` objects and the
    combined-1F1B scheduler) orders its nodes on CUDA streams with CUDA events and marks them
    with NVTX ranges; on a CPU there is one stream and everything is already ordered. Stands in
    for ``torch.cuda.Event`` (no-op record / wait), ``torch.cuda.current_stream`` and
    ``torch.cuda.Stream`` (None: ``torch.cuda.stream(None)`` is a no-op), ``torch.cuda.nvtx``'s
    ``range_push`` / ``range_pop`` and ``Tensor.record_stream``. These are torch attributes, so
    the scope is as narrow as the test that needs it; every one is restored on exit.
    """
    patches = [
        (torch.cuda, "Event", _NoEvent),
        (torch.cuda, "Stream", _nothing),
        (torch.cuda, "current_stream", _nothing),
        (torch.cuda.nvtx, "range_push", _nothing),
        (torch.cuda.nvtx, "range_pop", _nothing),
        (torch.Tensor, "record_stream", _nothing),
    ]
    saved = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in patches]
    try:
        for obj, name, stand_in in patches:
            setattr(obj, name, stand_in)
        yield
    finally:
        for obj, name, original in reversed(saved):
            if original is _ABSENT:  # inherited (Tensor.record_stream lives on TensorBase)
                delattr(obj, name)
            else:
                setattr(obj, name, original)


_ABSENT = object()
