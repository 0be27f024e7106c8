"""Imported once by the fork server that :func:`~mcore_hooks.testing.run_on_ranks` starts its
CPU ranks from: torch and the Megatron Core modules every rank imports, quietly, so that no rank
imports them again (about 6 s of CPU each)."""

from .._quiet import quiet_megatron

with quiet_megatron():
    import torch.distributed  # noqa: F401

    try:
        import megatron.core.models.gpt  # noqa: F401
        from megatron.core import parallel_state, tensor_parallel  # noqa: F401
    except ImportError:  # no Megatron Core here: each rank meets the error itself, and says so
        pass
