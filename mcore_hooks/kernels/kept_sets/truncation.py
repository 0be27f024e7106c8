"""A rollout engine's truncation (top-k, top-p, min-p) recomputed from the trainer's logits: the
options (:class:`Truncation`, per token :class:`TokenTruncation`) and each engine's rule over a
token's sorted candidates (:func:`truncate`), with the sampled label added where the rule
dropped it (:func:`with_labels`). The candidates and their logits come from
:mod:`..passes.candidates_op`'s top-k and :mod:`..passes.candidates`; the entry points put them together.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ..passes.candidates import label_columns
from ..common.debug import check_values
from ..common.dispatch import tracing
from ..common.options import is_finite

ENGINES = ("vllm", "sglang")

Values = Union[float, Sequence[float], torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class Truncation:
    """A rollout engine's truncation (top-k, top-p, min-p), recomputed from the trainer's own
    logits, by that engine's PyTorch rule as its released code writes it (vLLM 0.33.0's
    ``apply_top_k_top_p_pytorch`` after its Model Runner V2 ``min_p``; SGLang 0.5.23's
    ``top_k_top_p_min_p_sampling_from_probs_torch``). The logits are already divided by the
    temperature (the processor's or the kernel's ``temperature``).

    ``engine="vllm"``: min-p drops ``l < l_max + log(min_p)`` (float32); top-k keeps every logit
    ``>=`` the ``k``-th largest (all of its ties: a row can be wider than ``k``); top-p, over the
    top-k-renormalised distribution sorted ascending, drops while the float32 cumulative mass is
    ``<= 1 - top_p`` (``1 - top_p`` in float32), always keeping the most likely token.

    ``engine="sglang"``: on the full-vocabulary probabilities sorted descending (ties by
    ascending id, the label ahead of its ties: SGLang's own sort order is unspecified, and it
    sampled the label, so the label was in its set), top-k keeps exactly ``k`` by rank;
    top-p, on those unrenormalised probabilities, drops a token whose float32 cumulative mass
    before it exceeds ``top_p``; min-p last drops ``p < min_p * p_max``; a token whose
    probability is 0 in float32 is not kept.

    Not reproduced by any recomputation (replay their masks instead): vLLM's GPU sampler, a
    Triton kernel that departs from its PyTorch rule (with min-p and top-p together, all-equal
    rows, ties with min-p's dropped entries, top-p without top-k), and SGLang's FlashInfer
    backend (its CUDA default: top-k keeping ties, joint or renormalised top-p).
    ``docs/rollout.md`` has the measured differences.

    The label (the token the rollout sampled) is kept even where the recomputed set dropped it
    (the rollout did sample it; near a boundary the trainer's logits may differ from the
    rollout's); the kernels report where that happened (``label_outside``).

    Each of ``top_k``, ``top_p`` and ``min_p`` is one value, or one per request: a list or a
    1-D tensor, ``[b]`` (one per sample, or per packed sequence) for a processor, ``[N]`` (one
    per token) for the kernel functions; requests in one rollout batch have their own.

    Attributes:
        top_k: tokens kept by top-k; ``<= 0`` or more than the vocabulary means none (as vLLM
            normalises it). Required: it bounds the kept set the kernels gather. Per request, a
            list or a CPU tensor: batch-invariant in eager calls, the tokens grouped by their own set's width
            (a request's results the same bits beside requests with a wider top-k, or none), one
            pass a width, and vLLM's defaults (no top-k, ``top_p = 1``, ``min_p = 0``: the whole
            vocabulary, the plain statistics pass) a group of their own; a set that may be the whole vocabulary (no top-k) is never gathered,
            but given by a floor over the logits (:mod:`.nucleus`); or a device tensor with ``max_top_k``, which sizes every token's set (its
            widths are never read from the device). Processors keep a per-sample top-k on the
            host for unpacked batches; a packed batch's is spread on the device.
        top_p: the nucleus mass, in ``(0, 1]`` (1: off).
        min_p: the minimum probability relative to the most likely token, in ``[0, 1]`` (0: off).
        engine: ``"vllm"`` or ``"sglang"``: whose rule.
        ties: room gathered for logits tied with the ``k``-th beyond ``k``: with
            ``engine="vllm"`` its rule keeps them all (bf16-rounded logits tie often; at least 1
            is gathered, so a tie past the set is seen); with ``engine="sglang"``, where the
            label ties with the ``k``-th among them it is kept in place of one (tied beyond
            them, it is added as a ``k + 1``-th, and ``label_outside`` says so). A token whose
            vLLM ties do not fit is refused where values are checked, else gives NaN.
        max_top_k: the largest effective ``top_k`` when ``top_k`` is a device tensor (the
            vocabulary's size where some token has none).
    """

    top_k: Union[int, Sequence[int], torch.Tensor, None] = None
    top_p: Values = 1.0
    min_p: Values = 0.0
    engine: str = "vllm"
    ties: int = 16
    max_top_k: Optional[int] = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(map(repr, ENGINES))}, got {self.engine!r}")
        if self.top_k is None:
            raise ValueError(
                "top_k: required, e.g. Truncation(top_k=50, top_p=0.9): it bounds the kept set the "
                "fused kernels gather (the engines require a finite top_k to export a sampling mask "
                "too); one per request as a list or a CPU tensor")
        _check_ints("top_k", self.top_k)
        for name, lo_open in (("top_p", True), ("min_p", False)):
            _check_unit("top_p" if lo_open else "min_p", getattr(self, name), lo_open)
        if isinstance(self.ties, bool) or not isinstance(self.ties, int) or self.ties < 0:
            raise ValueError(f"ties: expected a non-negative int, got {self.ties!r}")
        if self.max_top_k is not None and (isinstance(self.max_top_k, bool)
                                           or not isinstance(self.max_top_k, int) or self.max_top_k < 1):
            raise ValueError(f"max_top_k: expected a positive int or None, got {self.max_top_k!r}")
        if isinstance(self.top_k, torch.Tensor) and self.top_k.device.type != "cpu":
            if self.max_top_k is None:
                raise ValueError(
                    "top_k: a device tensor needs max_top_k (its largest value, an int): the kept "
                    "set's width is read on the host, never from the device; or pass a list or a "
                    "CPU tensor")

    def _width(self, v_total: int) -> int:
        """The kept set's width: the largest effective top-k (none: the vocabulary), plus room
        for the ``k``-th value's ties, at most the vocabulary."""
        if self.max_top_k is not None:
            k = self.max_top_k
        else:
            ks = [int(self.top_k)] if isinstance(self.top_k, int) else _int_list(self.top_k)
            k = max(v_total if kk <= 0 or kk > v_total else kk for kk in ks) if ks else 1
        # vLLM's rule keeps ties, seen past the set by one more candidate at least (a k-th
        # value equal to the last gathered one may tie beyond); SGLang's keeps exactly k, the
        # room for the label's ties (see truncate)
        ties = max(1, self.ties) if self.engine == "vllm" else self.ties
        return max(1, min(v_total, k + ties))

    def _keeps_everything(self, v_total: int) -> bool:
        """Whether vLLM's rule keeps every token's whole vocabulary, as read on the host: no
        top-k (``<= 0`` or past the vocabulary), ``top_p = 1`` and ``min_p = 0`` everywhere
        (vLLM's defaults). False where an option is on the device (never read from there), and
        where traced (a value read on the host would break the graph)."""
        opts = self._host_options()
        if opts is None:
            return False
        k, p, m = opts
        return bool(((k <= 0) | (k >= v_total)).all()) and bool((p == 1).all()) and bool((m == 0).all())

    def _host_options(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(top_k, top_p, min_p)`` as host tensors (0-d where one value), for vLLM's rule;
        None where its keeping everything cannot be read on the host (SGLang's rule, whose
        set drops what float32 rounds to 0; an option on the device; traced code)."""
        if self.engine != "vllm" or self.max_top_k is not None or tracing():
            return None
        opts = (_host(self.top_k), _host(self.top_p), _host(self.min_p))
        return None if any(o is None for o in opts) else opts  # type: ignore[return-value]

    def _groups(self, n: int, v_total: int) -> Optional[list[tuple[torch.Tensor, "Truncation"]]]:
        """The tokens grouped by how their own options make their kept set, where every token's
        ``top_k`` is on the host (an int, a list or a CPU tensor) and more than one way occurs:
        ``[(the group's token indices (CPU), its options)]``. A way is the set's width (the
        width decides how its logits are made, and so their bits: a token's set is as wide as
        its own options make it, never as a wider request beside it makes it), or, for vLLM's
        rule, keeping the whole vocabulary (its defaults: the plain statistics pass, whatever
        truncates beside it). Else None: one way, a device top-k (its widths are not read from
        the device), or traced code (groups of data-dependent sizes would break the graph: a
        compiled call sizes every token's set by the largest). Per-request options of another
        length than ``n`` are refused, named, as :meth:`_per_token` refuses them."""
        top_k = self.top_k
        if self.max_top_k is not None or tracing() or (
                isinstance(top_k, torch.Tensor) and top_k.device.type != "cpu"):
            return None
        one = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if one(top_k) and one(self.top_p) and one(self.min_p):
            return None  # one request's options for every token: one way
        k = _per_token_vector("top_k", top_k, n, torch.long)
        for name in ("top_p", "min_p"):  # before any is sliced: a wrong length is refused, named
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
                _per_token_vector(name, value, n, torch.float32)
            elif value.shape != (n,):
                raise ValueError(f"truncation.{name}: expected one value or {n} (one per token), got "
                                 f"shape {tuple(value.shape)}")
        ties = max(1, self.ties) if self.engine == "vllm" else self.ties
        key = (torch.where((k <= 0) | (k > v_total), v_total, k) + ties).clamp(1, v_total)
        opts = self._host_options()
        if opts is not None:  # lengths checked above: each option one value or [n]
            everything = ((opts[0] <= 0) | (opts[0] >= v_total)) & (opts[1] == 1) & (opts[2] == 0)
            key = torch.where(everything.expand(n), 0, key)  # 0: never a width
        keys = key.unique()
        if keys.numel() < 2:
            return None

        def part(value: Values, index: torch.Tensor) -> Values:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
            t = torch.as_tensor(value)
            return t[index.to(t.device)]

        groups = []
        for w in keys.tolist():
            index = (key == w).nonzero().squeeze(1)
            groups.append((index, dataclasses.replace(self, top_k=k[index], top_p=part(self.top_p, index),
                                                      min_p=part(self.min_p, index))))
        return groups

    def _per_token(self, n: int, device: torch.device, v_total: int) -> "TokenTruncation":
        """The options as ``[n]`` tensors on ``device`` (one value, or one per token), top-k
        normalised (none: the vocabulary), and which tokens' options are out of range (only
        where device values cannot be checked: such a token gives NaN)."""
        k = _per_token_vector("top_k", self.top_k, n, torch.long, device)
        k = torch.where((k <= 0) | (k > v_total), v_total, k)
        p = _per_token_vector("top_p", self.top_p, n, torch.float32, device)
        min_p = _per_token_vector("min_p", self.min_p, n, torch.float32, device)
        bad = ~((p > 0) & (p <= 1) & (min_p >= 0) & (min_p <= 1))  # NaN fails too
        return TokenTruncation(k, p, min_p, bad)


def _per_token_vector(name: str, v, n: int, dtype: torch.dtype,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    """One option as ``[n]`` (one value spread, or one per token), on ``device`` (the host
    without one); another length refused, named."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return torch.full((n,), v, dtype=dtype, device=device)
    t = torch.as_tensor(v, dtype=dtype)
    if t.shape != (n,):
        raise ValueError(f"truncation.{name}: expected one value or {n} (one per token), got "
                         f"shape {tuple(t.shape)}")
    return t if device is None else t.to(device)


def _host(value: Values) -> Optional[torch.Tensor]:
    """An option as a host tensor (a scalar stays 0-d), or None where it is on a device."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else None
    return torch.as_tensor(value)


class TokenTruncation(NamedTuple):
    """:class:`Truncation`'s options per token, on the device."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    bad: torch.Tensor


def _int_list(v) -> list[int]:
    return [int(i) for i in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def _check_ints(name: str, v) -> None:
    if isinstance(v, bool) or isinstance(v, float):
        raise ValueError(f"{name}: expected an int or one per request, got {v!r}")
    if isinstance(v, int):
        return
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor (one per request), got {v.dtype} "
                             f"of shape {tuple(v.shape)}")
        return
    if not isinstance(v, (list, tuple)) or not v or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ValueError(f"{name}: expected an int or a non-empty list of ints (one per request), got {v!r}")


def _check_unit(name: str, v, lo_open: bool) -> None:
    """A float in (0, 1] (``lo_open``) or [0, 1], or one per request: a list (checked) or a
    tensor (checked where its values can be read without waiting on a device)."""
    interval = "(0, 1]" if lo_open else "[0, 1]"

    def ok(x) -> bool:
        return (isinstance(x, (int, float)) and not isinstance(x, bool) and is_finite(x)
                and (0 < x <= 1 if lo_open else 0 <= x <= 1))

    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or not v.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a 1-D float tensor (one per request), got {v.dtype} of "
                             f"shape {tuple(v.shape)}")
        inside = ((v > 0) if lo_open else (v >= 0)) & (v <= 1)  # NaN fails
        if check_values(v) and not bool(inside.all()):
            raise ValueError(f"{name}: every value must be in {interval}")
        return
    if isinstance(v, (list, tuple)):
        if not v or not all(ok(x) for x in v):
            raise ValueError(f"{name}: expected floats in {interval}, one per request, got {list(v)[:8]}")
        return
    if not ok(v):
        raise ValueError(f"{name}: expected a float in {interval}, got {v!r}")


def _descending(values: torch.Tensor, ids: torch.Tensor, first: Optional[torch.Tensor] = None,
                ids_ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates by value descending, ties by ascending id (one order, whatever order the
    search returned them in); ``first`` (``[N]`` ids, or None): that id ahead of its ties.
    ``ids_ascending``: the rows are in ascending id order already, padding (-1) last (a
    whole row): one sort fewer where no id goes first."""
    if first is not None or not ids_ascending:
        key = ids.masked_fill(ids < 0, torch.iinfo(torch.long).max)
        if first is not None:
            key = key.masked_fill(ids == first.unsqueeze(1), -1)
        by_id = key.argsort(dim=1, stable=True)
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=1, descending=True, stable=True)
    return values.gather(1, order), ids.gather(1, order)


def truncate(values: torch.Tensor, ids: torch.Tensor, t: TokenTruncation, engine: str,
             m: torch.Tensor, log_s: torch.Tensor, v_total: int,
             labels: Optional[torch.Tensor] = None, ids_ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept ids [N, Kc] with -1 where dropped, overflow [N])`` of each token's ``Kc`` largest
    float32 scaled logits ``values`` (any order) and their global ``ids``, by ``engine``'s rule
    (:class:`Truncation`). ``m`` and ``log_s``: the full vocabulary's statistics (SGLang's rule
    works on full-vocabulary probabilities). ``overflow``: vLLM's top-k keeps ties of the
    ``k``-th value that did not fit in ``Kc``. ``labels`` (SGLang's rule, whose top-k keeps
    exactly ``k`` by rank): each token's label goes ahead of the logits tied with it, so a label
    tied with the ``k``-th kept value is kept in place of one of them (the engine sampled it, so
    it was in its set; the set's mass is the same), not added as a ``k + 1``-th.
    ``ids_ascending``: as :func:`_descending`'s."""
    vals, ids = _descending(values.float(), ids, labels if engine == "sglang" else None, ids_ascending)
    n, kc = vals.shape
    neg = -math.inf  # a Python scalar: no host-to-device copy
    col = torch.arange(kc, device=vals.device).unsqueeze(0)
    k = t.top_k.clamp(max=kc).unsqueeze(1)
    # a token's top-k wider than the candidates gathered (a width given too small, or padding):
    # its set would be cut; refused or NaN, never silently short
    gathered = (ids >= 0).sum(dim=1)
    short = (t.top_k > gathered) & (gathered < v_total)
    if engine == "vllm":
        # min-p on the scaled logits: l < l_max + log(min_p), in float32 (log(0) = -inf: off)
        vals = torch.where(vals < vals[:, :1] + torch.log(t.min_p).unsqueeze(1), neg, vals)
        # top-k: everything below the k-th largest goes; its ties stay
        kth = vals.gather(1, k - 1)
        # the smallest candidate tied with the k-th, and more of the vocabulary than was gathered:
        # ties may lie beyond (padding, id -1, is not a candidate)
        smallest = torch.where(ids >= 0, vals, math.inf).amin(dim=1)
        overflow = short | ((t.top_k < v_total) & (gathered < v_total)
                            & (smallest >= kth.squeeze(1)) & torch.isfinite(kth.squeeze(1)))
        vals = torch.where(vals < kth, neg, vals)
        # top-p over the survivors' softmax, ascending: drop while the cumulative mass is
        # <= 1 - p (float32), never the largest
        asc = vals.flip(1)
        cum = torch.cumsum(torch.softmax(asc, dim=1), dim=1)
        drop = (cum <= (1 - t.top_p).unsqueeze(1)) & (t.top_p < 1).unsqueeze(1)
        drop[:, -1] = False
        vals = torch.where(drop.flip(1), neg, vals)
        keep = torch.isfinite(vals)
    else:
        overflow = short
        # the full vocabulary's probabilities, sorted descending, and their float32 cumulative sum
        prob = torch.exp(vals - m.unsqueeze(1)) / torch.exp(log_s).unsqueeze(1)
        cum = torch.cumsum(prob, dim=1)
        w = torch.where(col < k, prob, 0.0)  # top-k by rank
        w = torch.where(cum - prob > t.top_p.unsqueeze(1), 0.0, w)  # top-p, unrenormalised
        w = torch.where(w < w[:, :1] * t.min_p.unsqueeze(1), 0.0, w)  # min-p last
        keep = w > 0
    return torch.where(keep, ids, -1), overflow


def with_labels(kept: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept [N, k + 1], outside [N])``: ``kept`` with a last column holding each counted
    token's label where it was not kept (-1 elsewhere), and where that was."""
    found, _ = label_columns(kept, labels)
    outside = valid & ~found
    extra = torch.where(outside, labels, -1)
    return torch.cat([kept, extra.unsqueeze(1)], dim=1), outside
