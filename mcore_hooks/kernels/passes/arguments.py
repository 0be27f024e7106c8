"""The entry points' arguments: their checks (errors name the argument), their kernel form
(:class:`~..common.options.KernelParams`), the chunk sizes, and which backend runs them.

Nothing here computes a result: :mod:`mcore_hooks.kernels` (the entry points) calls
:func:`_prepare` first, so a bad argument is refused before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Optional, Union

import torch

from ..common.autograd import Backend, local_labels
from ..common.comm import group_rank_size
from ..common.debug import check_values
from ..common.dispatch import tracing
from ..common.invariant import block_rows
from ..common.options import KernelParams, is_finite
from ..torch_backend.torch_chunked import TorchChunked

BACKENDS = ("auto", "torch", "triton")


_log = logging.getLogger("mcore_hooks.kernels")  # the name the docs give


# Elements of one chunk's fp32 logits [chunk, V_local] the torch backend aims for (256 MiB).
_CHUNK_ELEMENTS = 1 << 26


def default_chunk_size(local_vocab: int) -> int:
    """The torch backend's default tokens per chunk.

    Args:
        local_vocab: this rank's vocabulary rows.

    Returns:
        About ``2**26`` fp32 logits' worth of tokens (256 MiB a chunk), at least 1.
    """
    return max(1, _CHUNK_ELEMENTS // max(1, local_vocab))


def _id_matrix(name: str, ids: Any, n: int, v_total: int, device: torch.device,
               valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, K] long ids on device, [N] bool: tokens with an id outside the vocabulary)``:
    checked, an integer matrix of one row per token; ids in the vocabulary or -1 where values
    are checked (an error), else such a token is flagged (its results are made NaN: no rank
    owns the id, which would otherwise count as a logit of 0). Only ``valid`` tokens are
    flagged: an ignored position's row, whatever it holds, is no input."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2 or ids.shape[0] != n or ids.shape[1] < 1:
        raise ValueError(f"{name}: expected shape ({n}, K) (K ids per token), got {tuple(ids.shape)}")
    ids = ids.to(device=device, dtype=torch.long)
    bad = (ids < -1) | (ids >= v_total)
    if check_values(ids) and bool(bad.any()):
        raise ValueError(f"{name}: ids must be in [0, {v_total}) or -1 (padding), got {int(ids[bad][0])}")
    bad = bad.any(dim=1)
    return ids, bad if valid is None else bad & valid


def _nan_where(p: KernelParams, bad: torch.Tensor) -> KernelParams:
    """``p`` with NaN logit coefficients for the tokens ``bad`` flags: their results, and their
    gradients, are NaN (bad input never gives a plausible number)."""
    return dataclasses.replace(p, coef=torch.where(bad, torch.nan, p.coef))


def _token_vector(name: str, t: Any, n: int, device: torch.device,
                  default: Optional[float] = None) -> torch.Tensor:
    """A float ``[N]`` per-token tensor, detached float32 on ``device``."""
    if t is None and default is not None:
        return torch.full((n,), default, dtype=torch.float32, device=device)
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},) (one per token), got {tuple(t.shape)}")
    # contiguous: the Triton kernels read a token's value at its index (a strided view, such
    # as a column of a [b, k] tensor, would read other tokens' values)
    return t.detach().to(device=device, dtype=torch.float32).contiguous()


def _prepare(hidden, weight, labels, temperature, logit_scale, ignore_index, parallel, chunk_size,
             backend, fused: bool = False, accumulator: Optional[torch.Tensor] = None,
             dummy_weight_grad: bool = False, upstream_grad: Optional[float] = None,
             batch_invariant: bool = True, fold_prologue: bool = False) -> KernelParams:
    """Check the arguments (errors name the argument) and put them in the kernels' form.
    ``fold_prologue``: the caller reads the params only through :func:`~.stats_op.stats`, so
    on one rank, with the Triton backend, a float temperature, values unchecked and nothing
    traced, the per-token inputs are left to the statistics pass (:attr:`KernelParams.prologue`;
    on a GPU, where the prologue's kernel would make them, and under Triton's interpreter, where
    its torch form would)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden: hidden size {hidden.shape[1]} does not match weight's {weight.shape[1]} "
            f"(weight is [vocab/tp, hidden] = {tuple(weight.shape)})"
        )
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise TypeError(
            f"hidden: dtype/device {hidden.dtype}/{hidden.device} differ from weight's "
            f"{weight.dtype}/{weight.device}"
        )
    _, tp = group_rank_size(parallel.group)
    sp = parallel.sequence_parallel and tp > 1
    n = hidden.shape[0] * (tp if sp else 1)
    v_total = weight.shape[0] * tp
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if 0 <= ignore_index < v_total:
        raise ValueError(
            f"ignore_index: {ignore_index} is a vocabulary id (vocab size {v_total}); use a "
            f"negative value such as -100"
        )
    if not (isinstance(logit_scale, (int, float)) and is_finite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale: expected a positive finite float, got {logit_scale!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
    backend_impl = _select_backend(backend, hidden)
    if chunk_size is None:
        # batch invariance on the torch backend: sized for one fixed block, whatever the number
        # of tokens (the Triton backend's products sum a row the same in any chunk)
        blocked = batch_invariant and backend_impl == "torch"
        chunk_size = (
            _fused_chunk_size(_backend_class(backend_impl), block_rows(hidden.device) if blocked else n,
                              weight.shape[0], hidden.element_size(),
                              into_accumulator=accumulator is not None and upstream_grad is not None)
            if fused else default_chunk_size(weight.shape[0])
        )
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")

    dev = hidden.device
    vocab_start, v_local = int(parallel.vocab_start), weight.shape[0]
    folded = None  # the prologue's inputs where the statistics pass makes what it would
    if labels is None:
        gl = torch.full((n,), -1, dtype=torch.long, device=dev)
        valid = torch.ones(n, dtype=torch.bool, device=dev)
        coef = _coefficients(temperature, logit_scale, n, dev, valid)
        local = gl
    else:
        if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels: expected an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
        if labels.shape != (n,):
            raise ValueError(f"labels: expected shape ({n},) (one per token), got {tuple(labels.shape)}")
        gl = labels.to(device=dev, dtype=torch.long)
        if fold_prologue and tp == 1 and backend_impl == "triton" and not tracing() \
                and _prologue_runs(gl) and not isinstance(temperature, torch.Tensor):
            folded = (float(logit_scale) / _scalar_temperature(temperature), ignore_index, v_total,
                      vocab_start, v_local)
            fast = None, None, None
        else:
            fast = _prologue(gl, temperature, logit_scale, ignore_index, n, v_total, vocab_start,
                             v_local)
        if fast is not None:
            valid, coef, local = fast
        else:
            valid = gl != ignore_index
            bad = valid & ((gl < 0) | (gl >= v_total))
            if check_values(bad) and bool(bad.any()):
                raise ValueError(
                    f"labels: {int(bad.sum())} id(s) outside [0, {v_total}) and not ignore_index="
                    f"{ignore_index}, e.g. {int(gl[bad][0])}"
                )
            coef = _coefficients(temperature, logit_scale, n, dev, valid)
            # unchecked (CUDA, debug checks off): such a token gives NaN, not a number
            coef = torch.where(bad, torch.nan, coef)
            local = local_labels(gl, valid, vocab_start, v_local)
    if accumulator is not None and (
        not isinstance(accumulator, torch.Tensor) or accumulator.dtype != torch.float32
        or accumulator.shape != weight.shape or accumulator.device != weight.device
    ):
        raise ValueError(
            f"weight_grad_accumulator: expected a float32 tensor of the weight's shape "
            f"{tuple(weight.shape)} on {weight.device}, got "
            f"{getattr(accumulator, 'dtype', type(accumulator).__name__)} "
            f"{tuple(getattr(accumulator, 'shape', ()))}"
        )
    if upstream_grad is not None:
        check_upstream_grad_option(upstream_grad)
        if accumulator is None:
            raise ValueError(
                "upstream_grad: declares the gradient that goes into weight_grad_accumulator in "
                "the forward; without an accumulator leave it None"
            )
        upstream_grad = float(upstream_grad)
    group = parallel.group if tp > 1 else None
    if batch_invariant:
        backend_impl += "+invariant"
    return KernelParams(gl, valid, coef, vocab_start, group, sp, chunk_size, backend_impl,
                        accumulator, dummy_weight_grad, upstream_grad, local, folded)


def _prologue(labels: torch.Tensor, temperature: Any, logit_scale: float, ignore_index: int, n: int,
              v_total: int, vocab_start: int, v_local: int):
    """``(valid, coef, local labels)`` in one Triton launch where the inputs are on a GPU it runs
    on and no value is to be checked (the torch form's dozen operations cost the host more than
    the GPU work of a small call); None elsewhere. The temperature's form is checked first."""
    if not labels.is_cuda or not _prologue_runs(labels):
        return None
    from ..triton_backend import triton_fused

    coef = 0.0
    if isinstance(temperature, torch.Tensor):
        _coefficient_tensor_checks(temperature, n)
        temperature = temperature.detach().to(device=labels.device, dtype=torch.float32).contiguous()
    else:
        coef = float(logit_scale) / _scalar_temperature(temperature)
        temperature = None
    return triton_fused.TritonFused.prologue(labels.contiguous(), temperature, coef, float(logit_scale),
                                             ignore_index, v_total, vocab_start, v_local)


def _prologue_runs(labels: torch.Tensor) -> bool:
    """Whether the prologue's kernel may form the per-token inputs: no value to be checked, not
    compiled, and Triton's tiles for the device (under Triton's interpreter, the CPU's too)."""
    if check_values(labels) or torch.compiler.is_compiling():
        return False
    from ..triton_backend import triton_tiles

    return triton_tiles.device_tiles(labels.device) is not None


def check_upstream_grad_option(upstream_grad: Any) -> None:
    """``upstream_grad``: None or a finite real number (errors name the argument)."""
    if upstream_grad is None:
        return
    if isinstance(upstream_grad, bool) or not isinstance(upstream_grad, (int, float)):
        raise TypeError(f"upstream_grad: expected a float or None, got {type(upstream_grad).__name__}")
    if not is_finite(upstream_grad):
        raise ValueError(f"upstream_grad: expected a finite value, got {upstream_grad!r}")


def _fused_chunk_size(backend: type[Backend], n: int, v_local: int, itemsize: int,
                      into_accumulator: bool = False) -> int:
    """Tokens per chunk of the losses with gradients formed in the forward: the chunk's logit
    gradient (input dtype) and half a chunk of fp32 logits within the backend's budget, balanced
    so the last chunk is not a sliver."""
    if n == 0:
        return 1
    budget = backend.chunk_bytes(into_accumulator)
    most = max(1, budget // (max(1, v_local) * (itemsize + 2)))
    chunks = -(-n // most)
    even = -(-n // chunks)
    if most < 256 or even >= n:
        return max(1, even)
    # a multiple of 256, so each half chunk is whole 128-row matmul tiles
    up = -(-even // 256) * 256
    return up if up <= most else even // 256 * 256


def _select_backend(name: str, hidden: torch.Tensor) -> str:
    """``auto``: Triton for bf16/fp16 on a CUDA GPU it has tiles for, else the torch backend.
    Returns the backend's name (the ops build it where they run)."""
    low_precision = hidden.dtype in (torch.bfloat16, torch.float16)
    tiles = _tiles_name(hidden.device) if name != "torch" else ""
    if name == "triton":
        if not tiles or not low_precision:
            from ..triton_backend import triton_fused

            why = (
                "triton is not importable" if triton_fused.triton is None
                else "not a CUDA device" if hidden.device.type != "cuda"
                else "no tile configuration fits this GPU (compute capability 8.0+ and 64 KiB of "
                "shared memory per block)" if not tiles
                else f"{hidden.dtype} inputs"
            )
            raise ValueError(
                "backend: 'triton' needs bf16/fp16 inputs on a CUDA GPU of compute capability "
                f"8.0+ with Triton installed, got {hidden.dtype} on {hidden.device} ({why}); "
                "backend='auto' falls back to 'torch'"
            )
        chosen = "triton"
    elif name == "auto" and low_precision and hidden.is_cuda and tiles:
        chosen = "triton"
    else:
        chosen = "torch"
    if not torch.compiler.is_compiling():  # logged from eager calls (Dynamo cannot trace logging)
        _log_choice(name, backend_name(chosen, tiles), hidden.dtype, hidden.device)
    return chosen


def _tiles_name(device: torch.device) -> str:
    """The name of the Triton tiles that run on ``device`` ("" where Triton cannot run)."""
    from ..triton_backend import triton_tiles  # lazily, here and below: it imports Triton, slow and optional

    tiles = triton_tiles.device_tiles(device)
    return "" if tiles is None else tiles.name


def _backend_class(name: str) -> type[Backend]:
    if name == "torch":
        return TorchChunked
    from ..triton_backend import triton_fused

    return triton_fused.TritonFused


def triton_unavailable() -> Optional[str]:
    """Why the Triton backend cannot run on this machine (None where it can: Triton imports and
    a CUDA device is there, or Triton's CPU interpreter is on), without a device to ask about;
    whether a given GPU has tiles is said where the kernels run."""
    from ..triton_backend import triton_fused

    if triton_fused.triton is None:
        return "Triton is not installed (pip install triton, or the 'triton' extra)"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device is available"
    return None


def backend_name(name: str, tiles: str = "") -> str:
    """``"torch"``, or ``"triton"`` with its tiles' name (``"triton (sm_90 tiles)"``)."""
    return name if name == "torch" else f"{name} ({tiles} tiles)"


def backend_for(dtype: torch.dtype, device: Union[str, torch.device], backend: str = "auto") -> str:
    """The backend the kernels run for inputs of ``dtype`` on ``device``.

    The first choice for each device and dtype is also logged (logger ``mcore_hooks.kernels``,
    level INFO).

    Args:
        dtype: the inputs' dtype.
        device: the inputs' device.
        backend: what would be asked for: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``"torch"``, or ``"triton (<family> tiles)"`` (e.g. ``"triton (sm_90 tiles)"``); for
        a CUDA device on a machine without one, a sentence saying so.

    Raises:
        ValueError: ``backend`` is unknown, or cannot run there.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # which tiles would run depends on the GPU, and there is none to ask
        return "none: no CUDA device here (on a GPU, 'triton (<family> tiles)' or 'torch')"
    probe = torch.empty(0, dtype=dtype, device=device)
    return backend_name(_select_backend(backend, probe), _tiles_name(device))


@functools.lru_cache(maxsize=None)
def _log_choice(asked: str, chosen: str, dtype: torch.dtype, device: torch.device) -> None:
    _log.info("backend=%r runs %s for %s inputs on %s", asked, chosen, dtype, device)


def _coefficient_tensor_checks(temperature: torch.Tensor, n: int) -> None:
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature: expected a float tensor, got {temperature.dtype}")
    if temperature.shape != (n,):
        raise ValueError(f"temperature: expected a float or shape ({n},), got {tuple(temperature.shape)}")


def _scalar_temperature(temperature: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float or tensor, got {type(temperature).__name__}")
    if not (is_finite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a positive finite value, got {temperature!r}")
    return float(temperature)


def _coefficients(temperature: Union[float, torch.Tensor], logit_scale: float, n: int,
                  dev: torch.device, valid: torch.Tensor) -> torch.Tensor:
    """``logit_scale / temperature`` per token, float32 ``[N]``. A per-token temperature that is
    not positive and finite raises where its values are checked, else gives NaN there; on an
    ignored token (not ``valid``) it is never read: 0 there, so the token adds exactly nothing
    (no 0 * inf in the gradients)."""
    if isinstance(temperature, torch.Tensor):
        _coefficient_tensor_checks(temperature, n)
        t = temperature.detach().to(device=dev, dtype=torch.float32)
        ok = torch.isfinite(t) & (t > 0)
        if check_values(t) and not bool((ok | ~valid).all()):
            raise ValueError("temperature: every value must be positive and finite (on every "
                             "token that is not ignore_index)")
        return torch.where(ok, float(logit_scale) / t, torch.where(valid, torch.nan, 0.0))
    coef = float(logit_scale) / _scalar_temperature(temperature)
    return torch.full((n,), coef, dtype=torch.float32, device=dev)
