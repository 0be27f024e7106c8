"""A rollout's kept sets: the distribution renormalised over each token's kept set (given ids,
or a rollout engine's truncation recomputed from the trainer's logits), and given ids' log-probs
under the full distribution.

:mod:`.truncation` holds the options (:class:`~.truncation.Truncation`) and each engine's rule,
:mod:`.nucleus` the floor pass for sets as wide as the vocabulary, and :mod:`.kept` the routes
:func:`mcore_hooks.kernels.linear_logprob_entropy` takes for them (and the kept ids a policy
loss hands it), over :mod:`..passes`.

The highest layer below the entry points: nothing else in :mod:`mcore_hooks.kernels` imports it.
"""
