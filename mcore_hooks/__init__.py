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
itself, on ``compat`` importing the package, and on a module other than ``hooked`` importing
postprocess, mtp and schedule_plan together):

1. ``kernels`` — the math on plain tensors and process groups, as ``torch.library`` ops: torch
   and triton only (with its value-check switch), never Megatron Core nor the rest of the
   package, so it can be read, used and tested alone.
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

from typing import Any

from .debug import debug_checks, set_debug_checks
from . import hooked
from .hooked import enable_output_processor, hooked_class, supports_output_processor
from .postprocess import (
    OUTPUT_PROCESSOR_KEYWORDS,
    DefaultProcessor,
    PostprocessContext,
    PostprocessProcessor,
    check_output_processor,
)
from .kernels import Truncation
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

__version__ = "0.1.0"

__all__ = [
    "OUTPUT_PROCESSOR_KEYWORDS",
    "DefaultProcessor",
    "EntropyProcessor",
    "FusedLogprobProcessor",
    "LinearCEProcessor",
    "LogprobEntropyProcessor",
    "PostprocessContext",
    "PolicyLossProcessor",
    "SelectedLogprobProcessor",
    "TopKDistillationProcessor",
    "Truncation",
    "PostprocessProcessor",
    "check_output_processor",
    "debug_checks",
    "enable_output_processor",
    "hooked_class",
    "megatron_upstream_grad",
    "set_debug_checks",
    "supports_output_processor",
]
# HookedGPTModel / HookedHybridModel / HookedMambaModel are public too, made on first access for
# the installed release; not in __all__, because a release may lack the class (HybridModel < 0.18)
# and `import mcore_hooks` does not import Megatron Core to find out.


def __getattr__(name: str) -> Any:
    if name in ("HookedGPTModel", "HookedHybridModel", "HookedMambaModel"):
        return getattr(hooked, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
