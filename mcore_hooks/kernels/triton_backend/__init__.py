"""The Triton backend (:class:`~.triton_fused.TritonFused`): the passes of
:mod:`..common.autograd` with the logits fused into the matmul, CUDA, bf16/fp16.

:mod:`.triton_fused` launches the passes over the vocabulary and :mod:`.triton_rows` the fused
losses' per-row ones; their kernels are in :mod:`.triton_kernels` and :mod:`.triton_losses`, the
tile shapes per GPU family in :mod:`.triton_tiles`, the direct launches in :mod:`.launch`.
Importing this package imports nothing: the modules that import Triton (slow, optional) are
imported lazily, where a Triton pass runs. Imports only :mod:`..common`.
"""
