"""The Triton backend's tile shapes per GPU family, and which the device at hand takes (read from
its compute capability and shared memory; no kernel is imported here, so asking costs nothing)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

try:  # Triton is optional; the torch backend needs none of this.
    import triton
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints on the host (``triton.cdiv`` is a JIT function: called from Python
    it unwraps its arguments as constexprs, some 5 us a call, 13 calls a log-prob call)."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One kernel's tile shape: ``[block_n tokens, block_v vocab]`` logits, ``block_k`` of the
    hidden size per step, ``num_stages`` of operand tiles in flight."""

    block_n: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_V=self.block_v, BLOCK_K=self.block_k,
                    num_warps=self.num_warps, num_stages=self.num_stages)

    def shared_memory(self, itemsize: int = 2) -> int:
        """Bytes of shared memory the kernel needs: the pipelined operand tiles, or the fp32
        logits tile when the epilogue moves it through shared memory (they are not live at once)."""
        operands = self.num_stages * (self.block_n + self.block_v) * self.block_k * itemsize
        return max(operands, self.block_n * self.block_v * 4)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The forward (statistics), logit-gradient and hidden-gradient kernels' tiles for one GPU
    family, and whether operands load through tensor descriptors (the bulk copy engine, compute
    capability 9.0+). ``dx`` (``dz @ W``, the log-prob backward's and the fused losses'):
    ``block_n`` tokens by ``block_v`` hidden columns of output, ``block_k`` vocabulary rows a
    step."""

    name: str
    min_capability: tuple[int, int]
    fwd: Tile
    bwd: Tile
    dx: Tile
    tma: bool

    def shared_memory(self) -> int:
        return max(self.fwd.shared_memory(), self.bwd.shared_memory(), self.dx.shared_memory())


# Largest first; a device takes the first its compute capability and per-block shared memory
# (opt-in limit) admit. sm_90's tiles are the fastest profiled on an H200 (wide vocab tiles
# amortise the softmax epilogue; 8 warps drive Hopper's wgmma): 144 KiB, which also fits
# sm_100's 227 KiB. sm_80 (A100, 163 KiB) keeps the wide tile with a shorter K step; sm_86 /
# sm_89 / sm_120 (99-100 KiB) take 128 x 128. Older GPUs have no bf16 tensor cores: torch backend.
# The hidden gradient's programs hold two float32 accumulators (a segment's partial sum and the
# running one, see _hidden_grad_kernel); on sm_90 its 128 x 256 tile still ran fastest, level
# with cuBLAS's product: 29.6 ms against 43.3 with 128 x 128 at 16384 x 4096 x 151936, 7.2 against
# 9.7 at 2048 x 8192 (cuBLAS 30.3 / 7.1; H200, benchmarks/profile_calls.py --dx-tiles, the first
# chunk's form; the same bits). Its later chunks' form (CONTINUE) spills registers; whole calls
# with such chunks still ran faster (benchmarks/RESULTS.md, 2026-11-27).
TILES: tuple[Tiles, ...] = (
    Tiles("sm_90", (9, 0), fwd=Tile(128, 256, 64, 8, 3), bwd=Tile(128, 256, 64, 8, 3),
          dx=Tile(128, 256, 64, 8, 3), tma=True),
    Tiles("sm_80", (8, 0), fwd=Tile(128, 256, 32, 8, 4), bwd=Tile(128, 256, 32, 8, 4),
          dx=Tile(128, 128, 32, 8, 4), tma=False),
    Tiles("sm_86", (8, 0), fwd=Tile(128, 128, 32, 8, 4), bwd=Tile(128, 128, 32, 8, 4),
          dx=Tile(128, 128, 32, 8, 4), tma=False),
)


def tiles_for(capability: tuple[int, int], shared_memory_per_block: int) -> Optional[Tiles]:
    """The tiles for a GPU of this compute capability and per-block shared memory, or None."""
    for tiles in TILES:
        if capability >= tiles.min_capability and tiles.shared_memory() <= shared_memory_per_block:
            return tiles
    return None


# device index -> its tiles, filled outside torch.compile (the backend is chosen in traced code,
# where an lru_cache makes Dynamo warn of possible silent incorrectness)
_TILES_BY_DEVICE: dict[int, Optional[Tiles]] = {}


def _device_tiles(index: int) -> Optional[Tiles]:
    if index in _TILES_BY_DEVICE:
        return _TILES_BY_DEVICE[index]
    props = torch.cuda.get_device_properties(index)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    tiles = tiles_for((props.major, props.minor), limit)
    if not torch.compiler.is_compiling():
        _TILES_BY_DEVICE[index] = tiles
    return tiles


def device_tiles(device: torch.device) -> Optional[Tiles]:
    """The tiles this backend runs with on ``device``; None where it cannot run (no Triton, not
    CUDA, or no configuration fits the GPU). Under Triton's interpreter (CPU tests): sm_90's."""
    if triton is None:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return TILES[0]
    if device.type != "cuda":
        return None
    return _device_tiles(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(index).multi_processor_count
