"""mcore-hooks: Megatron Core's ``output_processor`` hook on every supported release and model class.

Public API (everything else is internal):

* :class:`PostprocessProcessor` — subclass it and implement ``process(ctx)``;
* :class:`PostprocessContext` — the hook's keywords plus derived facts (TP rank, vocab range, ...);
* :class:`DefaultProcessor` — reproduces the stock output through the hook;
* :func:`enable_output_processor`, :func:`supports_output_processor`, :func:`hooked_class`;
* ``HookedGPTModel``, ``HookedHybridModel``, ``HookedMambaModel`` — classes to build directly
  (subclasses of the stock classes; where a class already has the hook, one that passes its
  calls through, adding the MTP loss hook);
* :func:`check_output_processor`, ``OUTPUT_PROCESSOR_KEYWORDS`` — the call convention;
* the bundled processors (:mod:`mcore_hooks.processors`): :class:`FusedLogprobProcessor`,
  :class:`EntropyProcessor`, :class:`LogprobEntropyProcessor`, :class:`LinearCEProcessor`,
  :class:`PolicyLossProcessor`; :func:`megatron_upstream_grad` (the ``upstream_grad`` to
  declare under Megatron's schedules);
* :func:`debug_checks`, :func:`set_debug_checks` — checks that read device values (label
  range, temperatures), off on CUDA by default to keep the hot path free of host syncs;
* :mod:`mcore_hooks.kernels` — the math on plain tensors: ``linear_logprob_entropy``,
  ``linear_cross_entropy``, ``linear_policy_loss``, ``PolicyLoss``, ``VocabParallel``.

``mcore_hooks.testing`` holds tiny CPU models and a multi-rank launcher for tests; ``mcore-hooks
verify`` (or ``python -m mcore_hooks verify``) checks the bundled processors against stock.

Layers (a module imports only from the modules listed before it; ``tests/test_structure.py``
reads every import and fails on a cycle, on ``kernels`` importing anything but torch, triton and
itself or its sub-packages importing against their order, on ``compat`` importing the package, on
a module other than ``hooked`` importing postprocess, mtp and schedule_plan together, and on a
folder of more than 15 modules):

1. ``kernels`` — the math on plain tensors and process groups, as ``torch.library`` ops: torch
   and triton only (with its value-check switch), never Megatron Core nor the rest of the
   package, so it can be read, used and tested alone. Its ``__init__`` is the entry points; its
   sub-packages, each importing only those after it: ``kept_sets`` (a rollout's kept sets and
   truncation), ``passes`` (the custom ops and their arguments), ``torch_backend`` and
   ``triton_backend``, ``common`` (options, the backends' shared algebra, communication).
2. ``compat`` — what the installed Megatron Core has (feature detection, release-specific call
   shapes), importing nothing of the package; ``main_grad`` — Megatron's gradient-accumulation
   fusion hand-off (torch only). Release differences are found by feature detection, through
   ``compat``'s questions.
3. ``mtp`` — the MTP loss hook and which output-layer calls are MTP depths (kernels, compat,
   main_grad); ``postprocess`` — the protocol: keywords, their check, the context, the base
   class (compat, mtp); ``schedule_plan`` — the combined-1F1B plan's seam (compat, mtp,
   postprocess).
4. ``hooked`` — the hooked classes (backport and native mixins, the output-layer interception,
   ``enable_output_processor``), the only module that assembles postprocess, mtp and
   schedule_plan.
5. ``processors`` (the bundled processors) and ``integrations`` (verl, NeMo RL), which adapt the
   protocol to the kernels; ``rollout`` (rollout engines' sampling masks as tensors, torch only).
6. ``verify``, ``cli``, ``testing`` — tools on top of the rest.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # the lazy names below, for type checkers and the API reference's reader
    from .debug import debug_checks, set_debug_checks
    from .hooked import enable_output_processor, hooked_class, supports_output_processor
    from .kernels import Truncation
    from .postprocess import (
        OUTPUT_PROCESSOR_KEYWORDS,
        DefaultProcessor,
        PostprocessContext,
        PostprocessProcessor,
        check_output_processor,
    )
    from .processors import (
        EntropyProcessor,
        FusedLogprobProcessor,
        LinearCEProcessor,
        LogprobEntropyProcessor,
        PolicyLossProcessor,
        SelectedLogprobProcessor,
        TopKDistillationProcessor,
        megatron_upstream_grad,
    )

# Lazy (PEP 562): `import mcore_hooks` (and so `mcore-hooks --help`, and `mcore_hooks._quiet`
# before Megatron Core's import) imports neither torch nor Megatron Core; a name is imported
# from its module on first use.
_WHERE = {
    "debug_checks": ".debug",
    "set_debug_checks": ".debug",
    "enable_output_processor": ".hooked",
    "hooked_class": ".hooked",
    "supports_output_processor": ".hooked",
    "OUTPUT_PROCESSOR_KEYWORDS": ".postprocess",
    "DefaultProcessor": ".postprocess",
    "PostprocessContext": ".postprocess",
    "PostprocessProcessor": ".postprocess",
    "check_output_processor": ".postprocess",
    "Truncation": ".kernels",
    "EntropyProcessor": ".processors",
    "FusedLogprobProcessor": ".processors",
    "LinearCEProcessor": ".processors",
    "LogprobEntropyProcessor": ".processors",
    "PolicyLossProcessor": ".processors",
    "SelectedLogprobProcessor": ".processors",
    "TopKDistillationProcessor": ".processors",
    "megatron_upstream_grad": ".processors",
    # made on first access for the installed release (see below)
    "HookedGPTModel": ".hooked",
    "HookedHybridModel": ".hooked",
    "HookedMambaModel": ".hooked",
}

# HookedGPTModel / HookedHybridModel / HookedMambaModel are public too, made on first access for
# the installed release; not in __all__, because a release may lack the class (HybridModel < 0.18)
# and `import mcore_hooks` does not import Megatron Core to find out.
__all__ = [name for name in _WHERE if not name.startswith("Hooked")]


# submodules, as attributes (`mcore_hooks.kernels.linear_cross_entropy` after `import mcore_hooks`)
_SUBMODULES = ("cli", "compat", "debug", "hooked", "integrations", "kernels", "main_grad", "mtp",
               "postprocess", "processors", "rollout", "schedule_plan", "testing", "verify")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    if not name.startswith("Hooked"):  # the hooked classes stay the hooked module's to make
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
