"""Drop-in processors for RL frameworks, keeping each framework's own contract.

* :mod:`mcore_hooks.integrations.verl`: verl's fused log-prob / entropy processor;
* :mod:`mcore_hooks.integrations.nemo_rl`: NeMo RL's linear-CE-fusion log-probs.

Neither framework is needed to import them.
"""
