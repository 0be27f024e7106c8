"""The math behind the processors, on plain tensors and process groups (no models).

Three entry points over ``softmax(scale * hidden @ weight.T / temperature)``, with a vocabulary that
may be split across the tensor-parallel group, never materialising ``[tokens, vocab]`` logits:
:func:`linear_logprob_entropy` (per-token log-probability of the labels and entropy),
:func:`linear_cross_entropy` (the cross-entropy reduced to one weighted sum) and
:func:`linear_policy_loss` (a policy loss, a weighted sum of per-token terms); the last two form
their gradients during the forward. They check their inputs and dispatch to a backend: ``torch`` (chunked, CPU and GPU, any dtype) or ``triton`` (logits fused
into the matmul, CUDA, bf16/fp16); ``auto`` takes Triton where it can run, else torch. Both keep
logits in fp32 and satisfy the same tests (values to fp32 rounding; gradients to the input dtype's).
This module is the entry points; the rest is in sub-packages, each importing only those after it:

* :mod:`.kept_sets`: the log-prob entry point's kept-set passes (:mod:`.kept_sets.kept`) and a
  rollout engine's truncation (:class:`Truncation`);
* :mod:`.passes`: the arguments' checks and the backend's choice (:mod:`.passes.arguments`), the
  passes as custom ops (:mod:`.passes.ops`, one module a pass);
* :mod:`.torch_backend` and :mod:`.triton_backend`: the two backends;
* :mod:`.common`: what they all share (options, the statistics' algebra, communication, guards).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch

from .common.debug import check_values
from .passes import stats_op
from .passes.arguments import (  # noqa: F401  (re-exported: the entry points' argument checks and backend choice)
    BACKENDS, _id_matrix, _nan_where, _prepare, _token_vector, backend_for, backend_name,
    check_upstream_grad_option, default_chunk_size, triton_unavailable,
)
from .common.autograd import TokenLoss
from .common.comm import group_rank_size
from .kept_sets.kept import kept_logprob_entropy, kept_sets_with_a_label, selected_logprobs
from .passes.routes import _fused, _no_tokens
from .common.losses import PerTokenLoss, PolicyLoss, PolicyLossResult, aggregation_weights, per_token_loss
from .common.options import KernelParams, LogprobEntropy, VocabParallel  # noqa: F401  (KernelParams: the passes' form of the arguments)
from .kept_sets.truncation import Truncation

__all__ = [
    "VocabParallel", "LogprobEntropy", "linear_logprob_entropy", "linear_cross_entropy",
    "linear_policy_loss", "PolicyLoss", "PolicyLossResult", "aggregation_weights", "per_token_loss",
    "TokenLoss", "BACKENDS", "backend_for", "default_chunk_size", "Truncation",
]


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    temperature: Union[float, torch.Tensor] = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    parallel: VocabParallel = VocabParallel(),
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    weight_grad_accumulator: Optional[torch.Tensor] = None,
    placeholder_weight_grad: bool = False,
    kept_ids: Optional[torch.Tensor] = None,
    truncation: Optional[Truncation] = None,
    selected_ids: Optional[torch.Tensor] = None,
    batch_invariant: bool = True,
) -> LogprobEntropy:
    """Per-token log-prob of ``labels`` and entropy, float32 ``[N]``, differentiable.

    Args:
        hidden: ``[N, H]`` hidden states, float32/bf16/fp16 (with ``parallel.sequence_parallel``,
            this rank's ``[N/tp, H]`` token shard; the outputs cover all ``N`` tokens).
        weight: ``[V_local, H]``, this rank's vocabulary shard, same dtype and device as ``hidden``.
        labels: ``[N]`` integer global vocabulary ids, or None for entropy only. Positions equal to
            ``ignore_index`` give 0 and no gradient (for log-prob and entropy alike).
        temperature: a positive float, or a float tensor ``[N]``, dividing the logits.
        logit_scale: a factor on the logits before the temperature (Megatron's MuP output scaling).
        parallel: the vocab-parallel layout (:class:`VocabParallel`).
        chunk_size: tokens per chunk of the torch backend (default: about 2**26 logits per
            chunk); the Triton backend never holds forward logits and sizes its backward's
            vocabulary chunks itself (their logit gradient at most 1 GiB, or one of 16
            vocabulary segments where that is more).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see :func:`backend_for`).
        weight_grad_accumulator: a float32 tensor shaped like ``weight`` (Megatron's
            ``main_grad``) that the weight's gradient is added into, in float32, instead of
            being returned (``weight`` then gets no gradient from this call).
        placeholder_weight_grad: with an accumulator, give ``weight`` a zero-stride zero
            gradient instead of none, so that hooks on its gradient (Megatron DDP's) still run,
            as Megatron's own layers hand back a placeholder.
        kept_ids: ``[N, K]`` integer global ids, each token's kept set (a rollout's sampling
            mask; -1 pads a row; no id twice in a row): the log-prob, entropy and ``logz`` are
            then of the distribution renormalised over the set. Only the ``K`` kept logits are
            made: for ``K <= V / 256`` (Triton backend; ``V / 1024`` torch) ``K`` gathered dot
            products a token, no pass over the vocabulary; wider, the ids' columns of one
            dense product. A row of -1 only (a
            prompt or padding position) gives 0 and no gradient. A counted token whose label is
            not in its non-empty set, or a repeated id, is bad input: an error where values are
            checked; unchecked, the label gives NaN and a repeated id counts twice.
        truncation: a :class:`Truncation` (top-k, top-p, min-p) recomputed from these logits:
            the kept set is then the truncation's (plus the label), found in one pass over
            the vocabulary (the torch backend's, whatever ``backend`` says: the Triton tiles
            keep no logits to rank), and the results are renormalised over it as with
            ``kept_ids``.
        selected_ids: ``[N, K]`` integer global ids per token (a teacher's top-k): their
            log-probabilities under the full distribution come back in ``selected``,
            differentiable (0 at -1 padding and ignored positions).
        batch_invariant: each token's results and its row of the hidden states' gradient
            bitwise independent of the other tokens in the call, of their number and of the
            chunking (the default; with ``kept_ids`` / ``selected_ids``, for a fixed width
            ``K``; with a ``truncation``, whose per-request ``top_k`` is on the host, also
            beside requests of other widths; :mod:`.common.invariant`). The Triton backend's passes are so as they are (each
            token's sums in one fixed shape, dX's too); the torch
            backend, and the BLAS products of either (wide id sets, the truncation's
            statistics), run on fixed-shape blocks of 2048 tokens on a GPU, 64 on the CPU,
            each cut into equal chunks (of the largest power of two at most half of
            ``chunk_size``, in every pass)
            (the torch backend's weight gradients added into one float32 buffer in order);
            kept sets are padded to 16 columns; sums over more than 2 tensor-parallel ranks
            are added in rank order, in float32, after an all-to-all of their terms. ``False``
            drops the blocks, the padding and the ordered sums (faster for a call far smaller
            than a block, and past 2 ranks). ``benchmarks/RESULTS.md`` has the cost.

    Returns:
        :class:`LogprobEntropy`: float32 ``[N]`` log-probs (None without labels) and entropies,
        differentiable with respect to ``hidden`` and ``weight``.

    Raises:
        ValueError: a shape, size, label (outside the vocabulary, where values are checked:
            see :func:`mcore_hooks.set_debug_checks`), temperature, scale, chunk size or backend
            that does not fit, named.
        TypeError: a dtype or device that does not fit, named.
    """
    kept = kept_ids is not None or truncation is not None
    # the params read by the statistics pass alone (no ids): its launches may make them
    p = _prepare(hidden, weight, labels, temperature, logit_scale, ignore_index, parallel,
                 chunk_size, backend, accumulator=weight_grad_accumulator,
                 dummy_weight_grad=placeholder_weight_grad, batch_invariant=batch_invariant,
                 fold_prologue=not kept and selected_ids is None)
    if kept and (labels is None or kept_ids is not None and truncation is not None or selected_ids is not None):
        raise ValueError(
            "kept_ids / truncation: a distribution renormalised over a kept set needs labels, "
            "and takes either kept_ids or truncation, not both, nor selected_ids (log-probs "
            "under the full distribution)")
    if truncation is not None and not isinstance(truncation, Truncation):
        raise TypeError(f"truncation: expected a Truncation, got {type(truncation).__name__}")
    v_total = weight.shape[0] * group_rank_size(parallel.group)[1]
    if p.n == 0:  # an empty micro-batch or shard: nothing to compute, nothing to communicate
        for name, ids in (("kept_ids", kept_ids), ("selected_ids", selected_ids)):
            if ids is not None:
                _id_matrix(name, ids, 0, v_total, hidden.device)
        return _no_tokens(hidden, weight, labels is not None,
                          None if selected_ids is None else selected_ids.shape[1], kept)
    if kept:
        def prepare_group(h: torch.Tensor, index: torch.Tensor, first: bool) -> KernelParams:
            # a group's tokens, as this call's arguments make them (its placeholder: the first's)
            temp = temperature
            if isinstance(temp, torch.Tensor) and temp.dim() == 1 and temp.shape[0] == p.n:
                temp = temp[index.to(temp.device)]
            return _prepare(h, weight, labels[index.to(labels.device)], temp, logit_scale,
                            ignore_index, parallel, chunk_size, backend,
                            accumulator=weight_grad_accumulator,
                            dummy_weight_grad=placeholder_weight_grad and first,
                            batch_invariant=batch_invariant)

        return kept_logprob_entropy(hidden, weight, p, v_total, truncation, kept_ids, prepare_group)
    if selected_ids is not None:
        return selected_logprobs(hidden, weight, p, selected_ids, v_total, with_label=labels is not None)
    logprob, entropy, logz, best = stats_op.stats(hidden, weight, p)
    if labels is None:
        return LogprobEntropy(None, entropy, logz)
    return LogprobEntropy(logprob, entropy, logz, best)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    token_weight: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    parallel: VocabParallel = VocabParallel(),
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    weight_grad_accumulator: Optional[torch.Tensor] = None,
    placeholder_weight_grad: bool = False,
    upstream_grad: Optional[float] = None,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """Reduced cross-entropy ``sum_i token_weight_i * -log p_i(labels_i)``, a float32 scalar.

    When a gradient is needed the logit gradients are formed in the forward, one token chunk at
    a time, so the forward does 3 matmuls and the backward only scales the result: the forward
    holds float32 dX ``[N, H]`` and dW ``[V_local, H]`` until the backward (each is rounded to the
    input dtype once; for few tokens on the Triton backend, the logit gradient instead, dW formed
    from it in the backward). Without a gradient it is the log-prob pass, reduced.

    Args:
        hidden: ``[N, H]`` (this rank's token shard under sequence parallelism).
        weight: ``[V_local, H]``, this rank's vocabulary shard.
        labels: ``[N]`` global vocabulary ids (``ignore_index`` where skipped).
        token_weight: float ``[N]`` weights (default: ones, the sum; ``mask / mask.sum()`` for a
            mean).
        temperature: a positive float, or a float tensor ``[N]``, dividing the logits.
        logit_scale: a factor on the logits before the temperature (MuP).
        ignore_index: the label of skipped positions.
        parallel: the vocab-parallel layout (:class:`VocabParallel`).
        chunk_size: tokens per chunk (default: their logit gradient and half a chunk of fp32
            logits in about 2.5 GiB with the Triton backend, 256 MiB with torch; the Triton
            backend makes the whole chunk's logits at once where they fit that budget, so a
            chunk_size of your own may hold up to 1.5x the memory half a chunk's would).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        weight_grad_accumulator: a float32 tensor shaped like ``weight`` (Megatron's
            ``main_grad``) that the weight's gradient is added into instead of being returned.
            The upstream gradient is known only in the backward (unless ``upstream_grad``
            declares it), so the weight's gradient goes into it there: the float32 dW formed in
            the forward (or the kept logit gradient's product) times the upstream gradient, in
            one pass; on the backward route (above) the logits recomputed, the weight's
            gradient in float32 straight into the accumulator.
        placeholder_weight_grad: with an accumulator, give ``weight`` a zero-stride zero
            gradient instead of none (see :func:`linear_logprob_entropy`).
        upstream_grad: with an accumulator, the gradient the returned loss will receive in its
            backward, declared in advance (under Megatron's schedules,
            ``mcore_hooks.megatron_upstream_grad``). The gradients are then
            formed in the forward (6NHV), ``upstream_grad * dW`` added into the accumulator
            there, so the forward must be followed by exactly one backward. The backward
            checks the gradient it receives on the device: a different one stops the process
            with a device-side assertion (on the CPU, a RuntimeError), never a wrong gradient.
        batch_invariant: each token's results and its row of the hidden states' gradient
            bitwise independent of the other tokens in the call, of their number and of the
            chunking (the default; with ``kept_ids`` / ``selected_ids``, for a fixed width
            ``K``; with a ``truncation``, whose per-request ``top_k`` is on the host, also
            beside requests of other widths; :mod:`.common.invariant`). The Triton backend's passes are so as they are (each
            token's sums in one fixed shape, dX's too); the torch
            backend, and the BLAS products of either (wide id sets, the truncation's
            statistics), run on fixed-shape blocks of 2048 tokens on a GPU, 64 on the CPU,
            each cut into equal chunks (of the largest power of two at most half of
            ``chunk_size``, in every pass)
            (the torch backend's weight gradients added into one float32 buffer in order);
            kept sets are padded to 16 columns; sums over more than 2 tensor-parallel ranks
            are added in rank order, in float32, after an all-to-all of their terms. ``False``
            drops the blocks, the padding and the ordered sums (faster for a call far smaller
            than a block, and past 2 ranks). ``benchmarks/RESULTS.md`` has the cost.

    Returns:
        The float32 scalar loss.

    Raises:
        ValueError: missing labels, or a shape, value or option that does not fit, named.
        TypeError: a dtype that does not fit, named.
    """
    if labels is None:
        raise ValueError("labels: linear_cross_entropy needs labels")
    p = _prepare(hidden, weight, labels, temperature, logit_scale, ignore_index, parallel,
                 chunk_size, backend, fused=True, accumulator=weight_grad_accumulator,
                 dummy_weight_grad=placeholder_weight_grad, upstream_grad=upstream_grad,
                 batch_invariant=batch_invariant)
    tw = _token_vector("token_weight", token_weight, p.n, hidden.device, default=1.0)
    return _fused(hidden, weight, p, tw, None, {})[0]


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    token_weight: torch.Tensor,
    loss: Union[PolicyLoss, PerTokenLoss, Callable[..., torch.Tensor], None] = None,
    inputs: Optional[Mapping[str, torch.Tensor]] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    parallel: VocabParallel = VocabParallel(),
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    weight_grad_accumulator: Optional[torch.Tensor] = None,
    placeholder_weight_grad: bool = False,
    upstream_grad: Optional[float] = None,
    kept_ids: Optional[torch.Tensor] = None,
    truncation: Optional[Truncation] = None,
    batch_invariant: bool = True,
) -> PolicyLossResult:
    """A policy loss ``sum_i token_weight_i * f(logprob_i, entropy_i, inputs_i)``, fused with the
    output layer, with its gradients formed in the forward.

    ``f`` is a per-token function: :class:`PolicyLoss` (PPO/GRPO clipped ratio, dual clip, KL to
    a reference, entropy bonus; the default), or any plain-torch function of per-token tensors
    made a :class:`TokenLoss` by :func:`per_token_loss`. Its derivatives in the token's log-prob
    and entropy are taken by autograd on each chunk's float32 values (:class:`PolicyLoss`'s
    written out in the Triton backend's kernels, operation for operation as autograd takes
    them), and the logit gradient is formed while the chunk's logits exist, as
    :func:`linear_cross_entropy` does and where it does (3 matmuls, 6NHV; the backward only
    scales the float32 dX and dW by the upstream gradient). The
    aggregation (token mean, sequence mean of token sums or means) is ``token_weight``: see
    :func:`aggregation_weights`. Objectives that couple tokens (sequence-level ratios such as
    GSPO's) are not per-token: take :func:`linear_logprob_entropy` and the loss in torch.

    Args:
        hidden: ``[N, H]`` (this rank's token shard under sequence parallelism).
        weight: ``[V_local, H]``, this rank's vocabulary shard.
        labels: ``[N]`` the sampled tokens' global ids (``ignore_index`` where skipped).
        token_weight: float ``[N]`` weight of each token's term (the loss mask divided by the
            aggregation's normaliser); a NaN or infinite weight is an error where values are
            checked.
        loss: the per-token function (default ``PolicyLoss()``).
        inputs: float ``[N]`` per-token tensors the function takes by name (for
            :class:`PolicyLoss`: ``old_logprobs``, ``advantages`` and, with a KL term,
            ``ref_logprobs``).
        temperature: a positive float, or a float tensor ``[N]``, dividing the logits.
        logit_scale: a factor on the logits before the temperature (MuP).
        ignore_index: the label of skipped positions (no term, no gradient).
        parallel: the vocab-parallel layout (:class:`VocabParallel`).
        chunk_size: tokens per chunk (as :func:`linear_cross_entropy`).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        weight_grad_accumulator: as :func:`linear_cross_entropy`'s (the weight's gradient
            added into it in float32 in the backward).
        placeholder_weight_grad: as :func:`linear_logprob_entropy`'s.
        upstream_grad: as :func:`linear_cross_entropy`'s (with an accumulator, the loss's
            gradient declared in advance: gradients formed in the forward, the weight's added
            into the accumulator there). Unused with a kept set.
        kept_ids: as :func:`linear_logprob_entropy`'s: the loss takes the log-probs and
            entropies renormalised over each token's kept set. Only the kept logits are made,
            so the terms are differentiated by autograd through them and the gradients formed
            in the backward. Positions of weight 0 add no term.
        truncation: as :func:`linear_logprob_entropy`'s, the kept set recomputed from the
            trainer's own logits; the loss uses it as ``kept_ids``.
        batch_invariant: each token's results and its row of the hidden states' gradient
            bitwise independent of the other tokens in the call, of their number and of the
            chunking (the default; with ``kept_ids`` / ``selected_ids``, for a fixed width
            ``K``; with a ``truncation``, whose per-request ``top_k`` is on the host, also
            beside requests of other widths; :mod:`.common.invariant`). The Triton backend's passes are so as they are (each
            token's sums in one fixed shape, dX's too); the torch
            backend, and the BLAS products of either (wide id sets, the truncation's
            statistics), run on fixed-shape blocks of 2048 tokens on a GPU, 64 on the CPU,
            each cut into equal chunks (of the largest power of two at most half of
            ``chunk_size``, in every pass)
            (the torch backend's weight gradients added into one float32 buffer in order);
            kept sets are padded to 16 columns; sums over more than 2 tensor-parallel ranks
            are added in rank order, in float32, after an all-to-all of their terms. ``False``
            drops the blocks, the padding and the ordered sums (faster for a call far smaller
            than a block, and past 2 ranks). ``benchmarks/RESULTS.md`` has the cost.

    Returns:
        :class:`PolicyLossResult`: the float32 scalar loss, and detached float32 ``[N]``
        log-probs and entropies (for metrics; entropies are 0 unless the loss uses them).

    Raises:
        ValueError: a shape, value or option that does not fit, or an input the loss needs
            that is missing, named.
        TypeError: a dtype that does not fit, named.
    """
    if labels is None:
        raise ValueError("labels: linear_policy_loss needs the sampled tokens as labels")
    p = _prepare(hidden, weight, labels, temperature, logit_scale, ignore_index, parallel,
                 chunk_size, backend, fused=True, accumulator=weight_grad_accumulator,
                 dummy_weight_grad=placeholder_weight_grad, upstream_grad=upstream_grad,
                 batch_invariant=batch_invariant)
    tw = _token_vector("token_weight", token_weight, p.n, hidden.device)
    if check_values(tw) and not bool(torch.isfinite(tw).all()):
        raise ValueError("token_weight: every value must be finite")
    fn = per_token_loss(PolicyLoss() if loss is None else loss)
    tensors = {k: _token_vector(f"inputs[{k!r}]", v, p.n, hidden.device) for k, v in (inputs or {}).items()}
    if kept_ids is not None or truncation is not None:
        fn.check_inputs(tensors)
        counted = p.valid & (tw != 0)
        if kept_ids is not None:
            v_total = weight.shape[0] * group_rank_size(parallel.group)[1]
            kept_ids = kept_sets_with_a_label(kept_ids, p, counted, tw, v_total)
        r = linear_logprob_entropy(
            hidden, weight, labels, temperature=temperature, logit_scale=logit_scale,
            ignore_index=ignore_index, parallel=parallel, chunk_size=chunk_size, backend=backend,
            weight_grad_accumulator=weight_grad_accumulator,
            placeholder_weight_grad=placeholder_weight_grad, kept_ids=kept_ids, truncation=truncation,
            batch_invariant=batch_invariant)
        ent = r.entropy if fn.needs_entropy else None
        terms = fn.bind(tw, tensors, p.valid).terms(slice(0, p.n), r.logprob, ent)
        total = torch.where(counted, terms, 0.0).sum()  # weight 0: no term, even NaN
        return PolicyLossResult(total, r.logprob.detach(),
                                r.entropy.detach() if fn.needs_entropy else torch.zeros_like(r.logprob),
                                r.label_outside)
    # exactly PolicyLoss (a subclass may change the formula the op would rebuild from the fields)
    # (and the loss's own entropy flag: a caller's may differ; not compared, as under
    # torch.compile(dynamic=True) they may be symbolic, which torch 2.13's Dynamo cannot compare)
    if type(fn.fn) is PolicyLoss and not fn.entropy_given:
        # data: the op takes it (and checks the inputs' values)
        fn.check_inputs(tensors)
        r = _fused(hidden, weight, p, tw, fn.fn, tensors)
    else:
        r = _fused(hidden, weight, p, tw, fn.bind(tw, tensors, p.valid), {})
    return PolicyLossResult(*r)
