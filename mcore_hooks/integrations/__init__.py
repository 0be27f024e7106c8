"""Drop-in processors for RL frameworks, keeping each framework's own contract.

* :mod:`mcore_hooks.integrations.verl`: verl's fused log-prob / entropy processor
  (:class:`VerlFusedProcessor`, :class:`FusedOutputProcessorContext`);
* :mod:`mcore_hooks.integrations.nemo_rl`: NeMo RL's linear-CE-fusion log-probs
  (:class:`NemoRLLogprobProcessor`).

Neither framework is needed to import them.
"""

from .nemo_rl import NemoRLLogprobProcessor
from .verl import FusedOutputProcessorContext, VerlFusedOutput, VerlFusedProcessor

__all__ = ["FusedOutputProcessorContext", "NemoRLLogprobProcessor", "VerlFusedOutput", "VerlFusedProcessor"]
