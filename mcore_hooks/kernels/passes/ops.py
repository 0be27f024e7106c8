"""The passes' custom ops (namespace ``mcore_hooks``), one module a pass, and what they share here:
the process group and the backend by name, and the hidden states' gradient's reduction.

The passes are ``torch.library`` custom ops with fake implementations and registered autograd,
so ``torch.compile(fullgraph=True)`` keeps them whole: Dynamo cannot trace a Triton launch with
our tiles, a ``torch.autograd.grad`` inside a forward, or a collective on a process group; as
opaque ops with fake (shape-only) implementations it does not have to. Their arguments are plain
data: tensors, ints, floats, strings, the process group by name (``ProcessGroup.group_name``),
the backend by name, and a per-token loss as :class:`~..common.losses.PolicyLoss`'s fields (a loss
given as an arbitrary Python function cannot be an op argument: it keeps
:class:`~.loss_op.LinearFusedLoss`, which compiles with a graph break). Eager calls run the same
implementations and autograd formulas without the dispatcher (:func:`~..common.dispatch.call`: the
dispatcher's own work was more than the GPU's at small calls).

* :mod:`.stats_op`: ``logsoftmax_stats`` / ``logsoftmax_stats_backward``, the 2NHV
  log-prob/entropy pass and its backward (which adds into ``accumulator``, Megatron's
  ``main_grad``, where one is given);
* :mod:`.candidates_op`: given ids' logits (``candidate_logits``, its backward) and the
  truncation's top-k (``top_k_ids``);
* :mod:`..kept_sets.nucleus`: a truncation's kept set as a floor over the logits (``truncation_floor``),
  where it may be the whole vocabulary;
* :mod:`.loss_op`: the fused losses (``fused_token_loss``, ``fused_token_loss_into_`` with a
  declared upstream gradient, ``accumulate_weight_grad_``), per-token terms (``token_terms``);
* here: ``all_reduce_`` / ``reduce_scatter_tokens``, the hidden-state gradient's reduction,
  which a backward traced by AOTAutograd cannot issue on a process group object itself.

Their formulas keep the contracts of :mod:`..common.guards` (an accumulator added into exactly once,
gradients formed in the forward never differentiated again).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..common import autograd as ag
from ..common import comm
from ..common.options import KernelParams
from ..common.invariant import InvariantBlocks, block_rows
from ..torch_backend.torch_chunked import TorchChunked
from ..common.dispatch import call, custom_op

_F32 = torch.float32


def group_name(group) -> Optional[str]:
    """A process group as an op argument (None: not split)."""
    return None if group is None else group.group_name


def _group(name: Optional[str]):
    if name is None:
        return None
    return torch.distributed.distributed_c10d._resolve_process_group(name)


def _backend(name: str, device: torch.device) -> ag.Backend:
    """The backend a name says: ``"torch"`` or ``"triton"``; ``"+invariant"`` (batch
    invariance, :mod:`..common.invariant`): the torch backend on fixed-shape token blocks, the Triton
    backend as it is (its passes sum each token in one order whatever the call)."""
    base, _, mode = name.partition("+")
    if base == "torch":
        aligned = mode == "invariant"
        backend: ag.Backend = TorchChunked(aligned=aligned)
        return InvariantBlocks(backend, block_rows(device)) if aligned else backend
    from ..triton_backend import triton_fused, triton_tiles  # lazily: they import Triton, slow and optional

    return triton_fused.TritonFused(triton_tiles.device_tiles(device))


def invariant(backend: str) -> bool:
    return backend.endswith("+invariant")


def _params(labels, valid, coef, vocab_start, group, sequence_parallel, chunk_size, backend,
            accumulator=None, upstream_grad=None) -> KernelParams:
    """An op's arguments as :class:`KernelParams`; ``labels`` are local rows there (the ops
    take ``KernelParams.local_labels``): in both fields, no global ids at hand."""
    return KernelParams(labels, valid, coef, vocab_start, _group(group), sequence_parallel,
                        chunk_size, backend, accumulator, False, upstream_grad, labels)


def _nothing(like: Tensor) -> Tensor:
    """An op cannot return None for a Tensor: an empty tensor stands for it."""
    return like.new_empty(0)


def _fake_group_size(name: Optional[str]) -> int:
    return 1 if name is None else _group(name).size()


@custom_op("mcore_hooks::all_reduce_", mutates_args=("t",))
def all_reduce_(t: Tensor, group: str, ordered: bool = False) -> None:
    """Sum ``t`` over the group, in place (``ordered``: in rank order, ``comm.all_reduce``)."""
    comm.all_reduce(t, torch.distributed.ReduceOp.SUM, _group(group), ordered)


@all_reduce_.register_fake
def _(t, group, ordered=False):
    return None


@custom_op("mcore_hooks::reduce_scatter_tokens", mutates_args=())
def reduce_scatter_tokens(t: Tensor, group: str, ordered: bool = False) -> Tensor:
    """Sum over the group, keep this rank's token shard (``ordered``: in rank order)."""
    return comm.reduce_scatter_tokens(t, _group(group), ordered)


@reduce_scatter_tokens.register_fake
def _(t, group, ordered=False):
    return t.new_empty((t.shape[0] // _fake_group_size(group),) + tuple(t.shape[1:]))


def reduce_hidden_grad(dx: Tensor, group: Optional[str], sequence_parallel: bool,
                       ordered: bool = False) -> Tensor:
    """:func:`~..common.comm.reduce_hidden_grad` through the ops (a backward traced by AOTAutograd
    cannot call a collective on a process group)."""
    if group is None:
        return dx
    if sequence_parallel:
        return call(reduce_scatter_tokens, dx, group, ordered)
    call(all_reduce_, dx, group, ordered)
    return dx
