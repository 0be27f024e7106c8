"""The debug switch for checks that must read tensor values.

Checking that every label is a vocabulary id, or that every per-sample temperature is positive,
means reading the tensors' values on the host: on a GPU that is a device synchronisation on every
call, which costs time and breaks CUDA graphs and ``torch.compile``. So on CUDA those checks run
only with debug checks on; off, an offending token's log-prob, entropy and loss are NaN (and so
are the gradients it feeds) instead of a silently wrong number. Tensors on the CPU are always
checked: reading them synchronises with nothing, except in a function ``torch.compile`` compiles
(its values are unknown while it is traced): there, as on CUDA, an offending token gives NaN.

Turn the checks on everywhere with the environment variable ``MCORE_HOOKS_DEBUG_CHECKS=1``, or in
code with :func:`set_debug_checks` / the :func:`debug_checks` context manager; ``False`` (or
``MCORE_HOOKS_DEBUG_CHECKS=0``) turns them off on the CPU too; ``None`` is the default (CPU only).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

__all__ = ["debug_checks", "debug_checks_enabled", "set_debug_checks"]

def _from_environment() -> Optional[bool]:
    value = os.environ.get("MCORE_HOOKS_DEBUG_CHECKS", "").strip().lower()
    if value in ("", "auto"):
        return None
    return value not in ("0", "false", "no", "off")


_ENABLED: Optional[bool] = _from_environment()


def debug_checks_enabled() -> Optional[bool]:
    """The current setting.

    Returns:
        True (value checks everywhere), False (nowhere) or None (default: CPU tensors only).
    """
    return _ENABLED


def set_debug_checks(enabled: Optional[bool]) -> None:
    """Turn the checks that read tensor values on or off, for this process.

    Args:
        enabled: True: everywhere; False: nowhere; None: on CPU tensors only (the default).

    Raises:
        TypeError: ``enabled`` is not True, False or None.
    """
    global _ENABLED
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True, False or None, got {enabled!r}")
    _ENABLED = enabled


@contextlib.contextmanager
def debug_checks(enabled: Optional[bool] = True) -> Iterator[None]:
    """A context manager: within the block, :func:`set_debug_checks` ``(enabled)``.

    Args:
        enabled: as for :func:`set_debug_checks`.

    Yields:
        Nothing; the previous setting is restored on exit.
    """
    previous = _ENABLED
    set_debug_checks(enabled)
    try:
        yield
    finally:
        set_debug_checks(previous)


def check_values(t: torch.Tensor) -> bool:
    """Whether to check ``t``'s values now (see :func:`set_debug_checks`). Not while
    ``torch.compile`` traces (values are not known then), unless debug checks were asked for,
    which then break the graph there."""
    if _ENABLED is None:
        return t.device.type == "cpu" and not torch.compiler.is_compiling()
    return _ENABLED
