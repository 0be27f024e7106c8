"""The passes as ``torch.library`` custom ops (namespace ``mcore_hooks``) with their autograd,
and the arguments they take.

:mod:`.arguments` checks the entry points' arguments into :class:`~..common.options.KernelParams`
and picks the backend; :mod:`.ops` holds what the ops share (the process group and the backend by
name, the hidden states' gradient's reduction); one module a pass: :mod:`.stats_op` (the
log-prob/entropy pass), :mod:`.candidates_op` (given ids' logits, the truncation's top-k, their
math in :mod:`.candidates`) and :mod:`.loss_op` (the fused losses); :mod:`.routes`, which of
them a fused loss runs, and the results of a call with no tokens.

Imports :mod:`..common` and the backends (the Triton one lazily), never :mod:`..kept_sets`.
"""
