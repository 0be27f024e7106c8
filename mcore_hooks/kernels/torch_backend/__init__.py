"""The PyTorch backend (:class:`~.torch_chunked.TorchChunked`): the passes of
:mod:`..common.autograd` in token chunks of float32 logits, on the CPU and the GPU, any dtype.

Imports only :mod:`..common`.
"""
