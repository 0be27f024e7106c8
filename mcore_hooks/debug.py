"""The debug switch for checks that must read tensor values (see :mod:`mcore_hooks.kernels.common.debug`,
where it lives: the kernels, the lowest layer, read it)."""

from .kernels.common.debug import check_values, debug_checks, debug_checks_enabled, set_debug_checks

__all__ = ["debug_checks", "debug_checks_enabled", "set_debug_checks", "check_values"]
