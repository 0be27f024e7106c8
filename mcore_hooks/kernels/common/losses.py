"""Per-token losses for the fused path (:class:`~.autograd.TokenLoss`): the weighted negative
log-likelihood behind :func:`~mcore_hooks.kernels.linear_cross_entropy`, and policy losses, the
PPO/GRPO objective (:class:`PolicyLoss`) or any per-token function in plain torch
(:func:`per_token_loss`), with their aggregation over tokens and sequences as token weights
(:func:`aggregation_weights`).

A per-token function's derivatives in the log-prob and entropy are taken by autograd on each
chunk's float32 values (a few ``[chunk]`` vectors), so a built-in or custom objective gets the same
gradient as the stock loss written with the same torch operations.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from .debug import check_values
from .comm import all_reduce
from .options import is_finite

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")


class PolicyLossResult(NamedTuple):
    """What :func:`~mcore_hooks.kernels.linear_policy_loss` returns.

    Attributes:
        loss: the float32 scalar loss (differentiable).
        logprob: detached float32 ``[N]`` log-probs of the labels (0 where ignored).
        entropy: detached float32 ``[N]`` entropies (0 where ignored, or where the loss does
            not use the entropy).
        label_outside: with a kept set, bool ``[N]``: the counted tokens whose label was not in
            it (see :class:`~mcore_hooks.kernels.LogprobEntropy`); None without one.
    """

    loss: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor
    label_outside: Optional[torch.Tensor] = None


class LossData(NamedTuple):
    """A per-token loss in a form a kernel evaluates with its derivatives (no autograd, no
    Python per chunk): the weighted NLL (``policy`` None) or a :class:`PolicyLoss` with its
    ``input_names`` tensors, full-call ``[N]`` float32, unmasked (the kernel zeroes the inputs of
    positions that do not count, as :meth:`PerTokenLoss.bind` does)."""

    token_weight: torch.Tensor
    policy: Optional["PolicyLoss"] = None
    inputs: tuple = ()


class WeightedNLL:
    """``sum_i w_i * -logprob_i``: the reduced cross-entropy."""

    needs_entropy = False

    def __init__(self, token_weight: torch.Tensor) -> None:
        self.token_weight = token_weight
        self.kernel_data = LossData(token_weight)

    def terms(self, rows: slice, logprob: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
        return -self.token_weight[rows] * logprob


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """The PPO / GRPO per-token objective (to be minimised), as verl's ``compute_policy_loss_vanilla``
    and ``kl_penalty`` write it.

    With ``r = exp(clamp(logprob - old_logprobs, -log_ratio_limit, log_ratio_limit))`` and
    advantage ``A``:

    * clipped surrogate (Schulman et al. 2017, arXiv:1707.06347; asymmetric "clip-higher" bounds
      as in DAPO, arXiv:2503.14476): ``pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``;
    * dual clip (Ye et al. 2020, arXiv:1912.09729), with ``dual_clip = c > 1``: where ``A < 0``,
      ``pg = min(pg, -A c)``;
    * KL to the reference policy (Schulman, "Approximating KL divergence", 2020), with
      ``d = ref_logprobs - logprob``: ``k1 = -d``; ``k3 = exp(d') - d' - 1`` with
      ``d' = clamp(d, -20, 20)``, clamped to ``[-10, 10]``; added as ``kl_coef * kl``;
    * entropy bonus: ``- entropy_coef * entropy``.

    Attributes:
        clip_low: ``epsilon_low`` of the clipped ratio (>= 0, < 1).
        clip_high: ``epsilon_high`` (>= 0; None: ``clip_low``).
        dual_clip: the dual-clip bound ``c`` (> 1), or None for none.
        kl_coef: the KL term's coefficient (0: no KL term, no ``ref_logprobs`` needed).
        kl_type: ``"k1"`` or ``"k3"`` (verl's ``low_var_kl``).
        entropy_coef: the entropy bonus' coefficient (0: the entropy is not computed).
        log_ratio_limit: the clamp of ``logprob - old_logprobs`` before ``exp`` (verl: 20).
    """

    clip_low: float = 0.2
    clip_high: Optional[float] = None
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0
    log_ratio_limit: float = 20.0

    def __post_init__(self) -> None:
        def number(name: str, v: Any, ok: Callable[[float], bool], what: str) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not is_finite(v) or not ok(v):
                raise ValueError(f"{name}: expected {what}, got {v!r}")

        number("clip_low", self.clip_low, lambda v: 0 <= v < 1, "a float in [0, 1)")
        if self.clip_high is not None:
            number("clip_high", self.clip_high, lambda v: v >= 0, "a float >= 0 or None")
        if self.dual_clip is not None:
            number("dual_clip", self.dual_clip, lambda v: v > 1, "a float > 1 or None")
        number("kl_coef", self.kl_coef, lambda v: True, "a finite float")
        if self.kl_type not in ("k1", "k3"):
            raise ValueError(f"kl_type: expected 'k1' or 'k3', got {self.kl_type!r}")
        number("entropy_coef", self.entropy_coef, lambda v: True, "a finite float")
        number("log_ratio_limit", self.log_ratio_limit, lambda v: v > 0, "a positive float")

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0

    @property
    def input_names(self) -> tuple[str, ...]:
        """The per-token inputs it takes."""
        return ("old_logprobs", "advantages") + (("ref_logprobs",) if self.kl_coef != 0 else ())

    # the inputs any configuration takes: one this configuration does not use (ref_logprobs with
    # kl_coef 0) is accepted and left aside, so a trainer can pass the same inputs whatever the loss
    known_inputs = ("old_logprobs", "advantages", "ref_logprobs")

    def __call__(
        self, logprob: torch.Tensor, entropy: Optional[torch.Tensor], *, old_logprobs: torch.Tensor,
        advantages: torch.Tensor, ref_logprobs: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Each token's loss term (any shape; elementwise)."""
        ratio = torch.exp(torch.clamp(logprob - old_logprobs, -self.log_ratio_limit, self.log_ratio_limit))
        high = self.clip_low if self.clip_high is None else self.clip_high
        pg = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - self.clip_low, 1 + high))
        if self.dual_clip is not None:
            pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * self.dual_clip), pg)
        if self.kl_coef != 0:
            if ref_logprobs is None:
                raise ValueError("ref_logprobs: needed by the KL term (kl_coef != 0)")
            if self.kl_type == "k1":
                kl = logprob - ref_logprobs
            else:
                d = torch.clamp(ref_logprobs - logprob, -20, 20)
                kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
            pg = pg + self.kl_coef * kl
        if self.entropy_coef != 0:
            pg = pg - self.entropy_coef * entropy
        return pg


class PerTokenLoss:
    """A per-token function ``fn(logprob, entropy, **inputs) -> [c] terms`` made a
    :class:`~.autograd.TokenLoss` for one call by :meth:`bind`."""

    def __init__(self, fn: Callable[..., torch.Tensor], needs_entropy: bool,
                 input_names: Optional[tuple[str, ...]], entropy_given: bool = False) -> None:
        self.fn, self.needs_entropy, self.input_names = fn, needs_entropy, input_names
        self.entropy_given = entropy_given  # needs_entropy said by the caller, not the loss
        # what a call must give, and may give (None: anything), by the loss's own account or,
        # for a plain function, by its signature fn(logprob, entropy, **inputs)
        if input_names is not None:
            self.required: Optional[tuple[str, ...]] = tuple(input_names)
            known = tuple(getattr(fn, "known_inputs", ()))  # a subclass may add its own names
            self.accepted: Optional[tuple[str, ...]] = tuple(dict.fromkeys(known + tuple(input_names)))
        else:
            self.required, self.accepted = _function_inputs(fn)

    def __repr__(self) -> str:
        return repr(self.fn)  # the loss as given (a PolicyLoss shows its fields)

    def check_inputs(self, inputs: Mapping[str, Any], what: str = "inputs") -> None:
        """ValueError naming ``what`` where ``inputs`` lacks a name the loss needs or has one it
        does not know (a name it knows but this configuration does not use is accepted)."""
        missing = [k for k in self.required or () if k not in inputs]
        extra = [] if self.accepted is None else [k for k in inputs if k not in self.accepted]
        if not missing and not extra:
            return
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"unexpected {', '.join(map(repr, extra))}"] if extra else [])
        takes = (f"the loss takes {', '.join(map(repr, self.required or ()))}"
                 + (f" (and accepts {', '.join(map(repr, sorted(set(self.accepted) - set(self.required or ()))))})"
                    if self.accepted is not None and set(self.accepted) - set(self.required or ()) else ""))
        raise ValueError(f"{what}: {'; '.join(parts)} ({takes})")

    def bind(self, token_weight: torch.Tensor, inputs: Mapping[str, torch.Tensor],
             valid: torch.Tensor) -> "_BoundPerTokenLoss":
        """This call's :class:`~.autograd.TokenLoss`: ``sum_i token_weight_i * fn(...)_i``. Inputs
        at positions that do not count (weight 0 or ignored) are replaced by 0 first, so padding
        that holds NaN or garbage contributes neither a value nor a gradient."""
        self.check_inputs(inputs)
        if any(check_values(t) for t in inputs.values()):
            counts = valid & (token_weight != 0)
            for name, t in inputs.items():
                if check_values(t) and not bool(torch.isfinite(t[counts]).all()):
                    raise ValueError(f"inputs[{name!r}]: NaN or infinite values at positions that count")
        return _BoundPerTokenLoss(self, token_weight, inputs, valid)


class _BoundPerTokenLoss:
    def __init__(self, loss: PerTokenLoss, token_weight: torch.Tensor,
                 inputs: Mapping[str, torch.Tensor], valid: torch.Tensor) -> None:
        self.loss, self.token_weight, self._raw, self._valid = loss, token_weight, inputs, valid
        self.needs_entropy = loss.needs_entropy
        self._safe: Optional[dict] = None
        # exactly PolicyLoss (a subclass may change the formula), its own entropy flag: a kernel
        # evaluates it (and zeroes the inputs that do not count itself)
        self.kernel_data = (LossData(token_weight, loss.fn, tuple(inputs[k] for k in loss.fn.input_names))
                            if type(loss.fn) is PolicyLoss and not loss.entropy_given else None)

    @property
    def inputs(self) -> dict:
        """The inputs, 0 at positions that do not count (weight 0 or ignored): padding that holds
        NaN or garbage contributes neither a value nor a gradient. Made on first use."""
        if self._safe is None:
            counts = self._valid & (self.token_weight != 0)
            self._safe = {k: torch.where(counts, v, 0.0) for k, v in self._raw.items()}
        return self._safe

    def terms(self, rows: slice, logprob: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
        f = self.loss.fn(logprob, entropy, **{k: v[rows] for k, v in self.inputs.items()})
        if not isinstance(f, torch.Tensor) or f.shape != logprob.shape:
            raise ValueError(
                f"loss: the per-token function must return one value per token (shape "
                f"{tuple(logprob.shape)}), got {tuple(getattr(f, 'shape', ())) or type(f).__name__}"
            )
        return f.float() * self.token_weight[rows]


def _function_inputs(fn: Any) -> tuple[Optional[tuple[str, ...]], Optional[tuple[str, ...]]]:
    """``(required, accepted)`` input names of ``fn(logprob, entropy, **inputs)`` from its
    signature: the parameters past the two positional ones (a ``*args`` takes those); accepted
    None (anything) with a ``**kwargs``, or where there is no signature to read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): nothing to check
        return None, None
    positional, inputs = 0, []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            positional = 2  # logprob and entropy land in *args
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and positional < 2:
            positional += 1
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            inputs.append(p)
    required = tuple(p.name for p in inputs if p.default is p.empty)
    accepted = None if any(p.kind is p.VAR_KEYWORD for p in params) else tuple(p.name for p in inputs)
    return required, accepted


def per_token_loss(
    loss: Any, *, needs_entropy: Optional[bool] = None
) -> PerTokenLoss:
    """A :class:`PolicyLoss` or a plain-torch function as the fused path's per-token loss.

    Args:
        loss: a :class:`PolicyLoss`, a :class:`PerTokenLoss`, or a function
            ``fn(logprob, entropy, **inputs)`` returning each token's term (elementwise, float;
            ``entropy`` is None when not computed). It is differentiated by autograd.
        needs_entropy: whether the function reads the entropy (default: the loss' own
            ``needs_entropy`` attribute, else True). False saves the entropy's work.

    Returns:
        The :class:`PerTokenLoss` that :func:`~mcore_hooks.kernels.linear_policy_loss` binds.
    """
    if isinstance(loss, PerTokenLoss):
        return loss
    if not callable(loss):
        raise TypeError(f"loss: expected a PolicyLoss or a per-token function, got {type(loss).__name__}")
    given = needs_entropy is not None
    if needs_entropy is None:
        needs_entropy = bool(getattr(loss, "needs_entropy", True))
    return PerTokenLoss(loss, needs_entropy, getattr(loss, "input_names", None), given)


def aggregation_weights(
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    sequence_ids: Optional[torch.Tensor] = None,
    num_sequences: Optional[int] = None,
    group: Any = None,
) -> torch.Tensor:
    """Token weights that make ``sum_i w_i * term_i`` the aggregated loss (verl's ``agg_loss``).

    * ``token-mean``: ``mask_i / max(1, sum mask)``;
    * ``token-sum``: ``mask_i``;
    * ``seq-mean-token-sum``: ``mask_i / S``, ``S`` the number of sequences with a token that
      counts (at least 1);
    * ``seq-mean-token-mean``: ``mask_i / (n_seq(i) * S)``, ``n_seq`` that sequence's count.

    The sums are taken over ``group`` too (context parallelism: each rank holds part of every
    sequence), so each rank's weights are its share of the whole batch's.

    Args:
        mask: ``[N]`` bool or float, the tokens that count (a float mask weighs them).
        mode: one of ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``.
        sequence_ids: ``[N]`` long, the sequence of each token in ``[0, num_sequences)`` (the
            ``seq-mean`` modes).
        num_sequences: how many sequences (the ``seq-mean`` modes).
        group: a process group to sum over (None: this rank alone).

    Returns:
        float32 ``[N]`` weights (no gradient).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode: expected one of {', '.join(map(repr, AGGREGATIONS))}, got {mode!r}")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1:
        raise ValueError(f"mask: expected a 1-D tensor (one per token), got {getattr(mask, 'shape', type(mask).__name__)}")
    m = mask.detach().float()
    if mode == "token-sum":
        return m
    if mode == "token-mean":
        return m / group_sum(m.sum(), group).clamp(min=1.0)
    if not isinstance(num_sequences, int) or isinstance(num_sequences, bool) or num_sequences < 1:
        raise ValueError(f"num_sequences: expected a positive int for {mode!r}, got {num_sequences!r}")
    if (not isinstance(sequence_ids, torch.Tensor) or sequence_ids.shape != m.shape
            or sequence_ids.dtype.is_floating_point or sequence_ids.dtype == torch.bool):
        raise ValueError(
            f"sequence_ids: expected an integer tensor of shape {tuple(m.shape)} for {mode!r}, got "
            f"{getattr(sequence_ids, 'dtype', type(sequence_ids).__name__)} "
            f"{tuple(getattr(sequence_ids, 'shape', ()))}"
        )
    ids = sequence_ids.to(device=m.device, dtype=torch.long)
    if check_values(ids) and bool(((ids < 0) | (ids >= num_sequences)).any()):
        raise ValueError(f"sequence_ids: values must lie in [0, {num_sequences})")
    counts = torch.zeros(num_sequences, dtype=torch.float32, device=m.device).index_add_(0, ids, m)
    counts = group_sum(counts, group)
    num = (counts != 0).sum().float().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return m / num
    per_seq = counts[ids]
    return torch.where(per_seq != 0, m / (per_seq * num), 0.0)


def group_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` summed over ``group`` (a detached copy; ``t`` itself where there is no group)."""
    return all_reduce(t.detach().clone(), dist.ReduceOp.SUM, group)
