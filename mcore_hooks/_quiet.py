"""Silence the notes Megatron Core prints about itself when the tiny test models are built and run.

On a CPU machine without Transformer Engine or Apex, importing Megatron Core and building tiny
models prints dozens of lines per rank (missing optional packages, deprecated model classes,
CUDA-only tuning advice) before any result. They say nothing about the check being run, so the
test tools (``mcore_hooks.testing``, ``mcore-hooks verify``) drop exactly these, by message; any
other warning or log record still shows. It lives outside ``mcore_hooks.testing`` so the command
line can enter it before anything imports Megatron Core.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import warnings
from typing import Any, Iterator

__all__ = ["KNOWN_NOTES", "call_quietly", "quiet_megatron"]

# Each pattern matches the start of one note Megatron Core (or torch, when Megatron imports its
# extension loader) emits on a CPU machine for the tiny models, as a warning or a log record.
KNOWN_NOTES: tuple[str, ...] = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"full scope is deprecated",
    r"When using async grad allreduce it is recommended to set the environment variable "
    r"CUDA_DEVICE_MAX_CONNECTIONS",
    r"GPTModel IS DEPRECATED",
    r"MambaModel has been deprecated",
    r"No CUDA runtime is found",
    r"Failed to create unified memory mempool",  # 0.15's inference module, imported without CUDA
    r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine' \s*module is deprecated",
    r"MLP requires ffn_hidden_size",
    r"Encoder-specific pipeline parallelism functionality is deprecated",  # 0.13's layers
    r"The following imports from `dynamic_context\.py` will be removed",
    r"`torch\.jit\.script(_method)?` is deprecated",  # Megatron's jit-scripted fusions
    r"Warning\x3a tp_group is None, using default tp group",  # \x3a: a colon (filter syntax)
    # Megatron's tensor-parallel mappings call collectives that torch 2.13 deprecates
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
)
_NOTE = re.compile("|".join(f"(?:{p})" for p in KNOWN_NOTES))


class _DropKnownNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _NOTE.match(record.getMessage())


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Within the block, :data:`KNOWN_NOTES` are not shown (warnings and log records alike);
    everything is as before on exit.

    A logger's filters see only the records logged on it, so the filter goes where the notes
    end up: torch's extension-loader logger (torch gives it a handler of its own), and the root
    logger's handlers and Python's last-resort handler, which Megatron's handler-less loggers
    reach.
    """
    note_filter = _DropKnownNotes()
    targets = [
        logging.getLogger("torch.utils.cpp_extension"),
        *logging.getLogger().handlers,
        *([logging.lastResort] if logging.lastResort is not None else []),
    ]
    with warnings.catch_warnings():
        for pattern in KNOWN_NOTES:
            warnings.filterwarnings("ignore", message=pattern)
        for target in targets:
            target.addFilter(note_filter)
        try:
            yield
        finally:
            for target in targets:
                target.removeFilter(note_filter)


def call_quietly(module: str, name: str, *args: Any) -> Any:
    """``module.name(*args)`` inside :func:`quiet_megatron`, the module imported inside it too.

    The target of spawned test ranks: given by name, so that unpickling the process target in the
    child imports nothing of Megatron Core before the notes are silenced.
    """
    with quiet_megatron():
        return getattr(importlib.import_module(module), name)(*args)
