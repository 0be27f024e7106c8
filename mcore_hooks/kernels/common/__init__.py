"""What every pass and both backends share, on plain tensors and process groups: the options as
data (:mod:`.options`), the statistics' algebra and the :class:`~.autograd.Backend` protocol
(:mod:`.autograd`), batch invariance's fixed-shape blocks (:mod:`.invariant`), the per-token
losses (:mod:`.losses`), float32 products (:mod:`.matmul`), the tensor-parallel group's
communication (:mod:`.comm`), the custom ops' eager dispatch (:mod:`.dispatch`), the guards of
the passes' contracts (:mod:`.guards`) and the debug switch for value checks (:mod:`.debug`).

The lowest layer of :mod:`mcore_hooks.kernels`: it imports none of the other sub-packages.
"""
