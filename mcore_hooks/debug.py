"""The debug switch for checks that must read tensor values.

Checking that every label is a vocabulary id, or that every per-sample temperature is positive,
means reading the tensors' values on the host: on a GPU that is a device synchronisation on every
call, which costs time and breaks CUDA graphs and ``torch.compile``. So on CUDA those checks run
only with debug checks on; off, an offending token's log-prob, entropy and loss are NaN (and so
are the gradients it feeds) instead of a silently wrong number. Tensors on the CPU are always
checked: reading them synchronises with nothing.

Turn the checks on with the environment variable ``MCORE_HOOKS_DEBUG_CHECKS=1``, or in code with
:func:`set_debug_checks` / the :func:`debug_checks` context manager.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["debug_checks", "debug_checks_enabled", "set_debug_checks"]

_ENABLED = os.environ.get("MCORE_HOOKS_DEBUG_CHECKS", "").strip().lower() not in ("", "0", "false", "no")


def debug_checks_enabled() -> bool:
    """Whether checks that read device values run (see the module docstring)."""
    return _ENABLED


def set_debug_checks(enabled: bool) -> None:
    """Turn the value checks on CUDA tensors on or off for this process."""
    global _ENABLED
    _ENABLED = bool(enabled)


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Within the block, value checks on CUDA tensors are on (or off); restored on exit."""
    previous = _ENABLED
    set_debug_checks(enabled)
    try:
        yield
    finally:
        set_debug_checks(previous)


def check_values(t: torch.Tensor) -> bool:
    """Whether to check ``t``'s values now: always on the CPU, on other devices in debug mode."""
    return _ENABLED or t.device.type == "cpu"
