"""The configuration space of the processors, sampled: every pair of options at least once.

Each combination runs every bundled processor and both integrations under tensor parallelism
(vocab-parallel output weight), sequence parallelism, context parallelism (Megatron's
load-balanced layout, per packed sequence for THD), packed sequences, tied weights, scalar or
per-sample temperatures, given or derived labels, a loss mask, the output weight's gradient
into ``main_grad`` (with and without a declared ``upstream_grad``), the path the gradient takes
(``forward``: the loss's backward; ``plan``: the combined-1F1B plan's post-process node, its loss
node handing back each output's gradient, the processors returning tuples), which outputs the
loss uses (all, or the first: an entropy only logged), a non-reentrant activation-checkpointed
region around the call, one or two MTP depths' fused loss on the same weight, the deferred
embedding weight gradient of pipeline parallelism (``defer_embedding_wgrad_compute``), the torch backend's
``chunk_size`` (the default, or 3: chunks of 1-2 tokens), a declared ``upstream_grad``'s forward
failing halfway (``fault``: the loss raising on its fourth chunk half; ``main_grad`` is NaN with a
warning, then a retry on a cleared ``main_grad`` must be exact), and the
batch invariance (on, the default, or opted out), and ``torch.compile`` around the call (graph breaks allowed), on 4
gloo CPU ranks in float32, and compares values and gradients with the same processor on the
unsplit batch (itself checked against stock Megatron by the rest of the suite). A combination either matches or is refused
before anything is written, with an error naming it. ``python tests/configuration_space.py``
prints the matrix as docs/testing.md's table.

The shards are cut by loops written from Megatron's layout, independently of the library.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import types
from typing import Any, Optional

import torch
from ddp_like import ddp_like

PROCESSORS = ("logprob", "entropy", "logprob-entropy", "ce-none", "ce-sum", "ce-mean",
              "policy-token-mean", "policy-seq-mean-token-mean", "verl", "nemo-rl",
              # rollout parity: a sampling mask replayed (log-prob + entropy, the policy loss), a
              # truncation recomputed (vLLM's rule; SGLang's with per-request options; vLLM's with
              # per-request widths, one request keeping everything), log-probs of given ids, top-k
              # distillation
              "kept-replay", "kept-top-k", "kept-top-k-per-request", "kept-mixed-widths", "kept-policy",
              "selected", "distill")
# option -> values; the first value is the plain one
OPTIONS: dict[str, tuple] = {
    "processor": PROCESSORS,
    "tp": (1, 2),
    "sp": (False, True),
    "cp": (1, 2),
    "packed": (False, True),
    "tied": (False, True),
    "temperature": ("scalar", "per-sample"),
    "labels": ("given", "derived"),
    "loss_mask": (False, True),
    "main_grad": ("off", "on", "declared"),
    "path": ("forward", "plan"),
    "uses": ("all", "first"),
    "checkpoint": ("none", "region"),
    "mtp": (0, 1, 2),
    "defer_wgrad": (False, True),
    "invariant": (False, True),
    "compile": (False, True),
    "chunk_size": ("default", 3),
    "fault": (False, True),
}
DECLARABLE = ("ce-sum", "ce-mean", "policy-token-mean", "policy-seq-mean-token-mean")
TWO_OUTPUTS = ("logprob-entropy", "verl", "kept-replay")  # two differentiable outputs: the loss may use one
REDUCED = ("ce-sum", "ce-mean", "nemo-rl", "kept-policy", "distill")  # a loss, then per-token values
B, S, H, V = 2, 8, 8, 32
KEPT, TOP_K = 6, 4  # a kept set's ids a token (the label among them); a teacher's top-k
LENGTHS, PADDED = (5, 7), (8, 8)  # packed: real and padded (a multiple of 2 cp * tp) lengths
UPSTREAM = 0.5  # the gradient the reduced losses receive: loss * 0.5


@dataclasses.dataclass(frozen=True)
class Combo:
    processor: str
    tp: int
    sp: bool
    cp: int
    packed: bool
    tied: bool
    temperature: str
    labels: str
    loss_mask: bool
    main_grad: str
    path: str = "forward"
    uses: str = "all"
    checkpoint: str = "none"
    mtp: int = 0
    defer_wgrad: bool = False
    invariant: bool = False
    compile: bool = False
    chunk_size: Any = "default"
    fault: bool = False

    def name(self) -> str:
        parts = [self.processor, f"tp{self.tp}", "sp" if self.sp else "", f"cp{self.cp}",
                 "thd" if self.packed else "bshd", "tied" if self.tied else "",
                 "T[b]" if self.temperature == "per-sample" else "", f"labels-{self.labels}",
                 "mask" if self.loss_mask else "", f"main_grad-{self.main_grad}", self.path,
                 "uses-first" if self.uses == "first" else "",
                 "checkpointed" if self.checkpoint == "region" else "",
                 f"mtp{self.mtp}" if self.mtp else "", "defer-wgrad" if self.defer_wgrad else "",
                 "batch-invariant" if self.invariant else "", "compiled" if self.compile else "",
                 f"chunk{self.chunk_size}" if self.chunk_size != "default" else "",
                 "fault-then-retry" if self.fault else ""]
        return " ".join(p for p in parts if p)


def valid(c: dict) -> bool:
    """Combinations that exist: SP needs TP; only the reduced losses take an upstream_grad; only
    a processor with two differentiable outputs can have one of them unused."""
    if c.get("sp") and c.get("tp") == 1:
        return False
    if c.get("main_grad") == "declared" and c.get("processor") not in (None, *DECLARABLE):
        return False
    if c.get("uses") == "first" and c.get("processor") not in (None, *TWO_OUTPUTS):
        return False
    if c.get("uses") == "first" and c.get("main_grad") == "declared":  # no processor has both
        return False
    # a fault: a policy loss's declared forward failing halfway, on one rank (ranks
    # failing at different chunks would leave the others waiting in a collective), eager
    if c.get("fault") and not (c.get("main_grad") in (None, "declared")
                               and (c.get("processor") or "policy-").startswith("policy-")
                               and c.get("tp") in (None, 1) and not c.get("sp") and c.get("cp") in (None, 1)
                               and not c.get("compile") and c.get("chunk_size") in (None, 3)
                               and c.get("uses") in (None, "all") and c.get("checkpoint") in (None, "none")):
        return False
    return True


def expected_refusal(c: Combo) -> Optional[str]:
    """The error a combination must raise before anything runs (a regex; any of them where
    several apply), or None: exact."""
    why = []
    if c.labels == "derived" and c.cp > 1 and c.processor != "nemo-rl":
        why.append("labels: must be passed .* under context parallelism")
    if c.defer_wgrad:
        why.append("defer_embedding_wgrad_compute: the output layer defers its weight gradient")
    if c.main_grad == "declared" and c.checkpoint == "region":
        why.append("upstream_grad: the loss is computed under saved-tensor hooks")
    return "|".join(why) or None


def _refused_pair(a: str, va: Any, b: str, vb: Any) -> bool:
    """A pair of option values that is refused whatever the other options are."""
    d = {a: va, b: vb}
    return d.get("defer_wgrad") is True or (d.get("main_grad") == "declared" and d.get("checkpoint") == "region")


def covering_set() -> list[Combo]:
    """A deterministic set of valid combinations in which every pair of option values (that can
    meet) appears at least once in a row that runs, or, for a pair refused whatever else is set,
    in a refused row: greedy, each new row the candidate covering most uncovered pairs per unit
    of cost (a compiled row costs about 30 plain ones on the CPU, Dynamo's tracing: so they come
    last, as few as the pairs with ``compile`` need)."""
    names = list(OPTIONS)
    uncovered = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        for va in OPTIONS[a]:
            for vb in OPTIONS[b]:
                if valid({a: va, b: vb}):
                    uncovered.add((i, va, j, vb))
    rng = random.Random(0)
    rows: list[Combo] = []
    while uncovered:
        best, best_gain = None, -1.0
        for _ in range(200):
            cand = {n: rng.choice(OPTIONS[n]) for n in names}
            # seed each candidate with one uncovered pair so progress never stalls (sorted: a
            # set's order changes with the process's string hashing)
            pending = sorted(uncovered, key=repr)
            i, va, j, vb = pending[0] if rng.random() < 0.5 else rng.choice(pending)
            cand[names[i]], cand[names[j]] = va, vb
            if cand["fault"]:  # the fault's few companions, except the seeded pair's
                need = dict(main_grad="declared", tp=1, sp=False, cp=1, compile=False, chunk_size=3,
                            uses="all", checkpoint="none", processor=rng.choice([p for p in PROCESSORS if p.startswith("policy-")]))
                cand.update({k: v for k, v in need.items() if k not in (names[i], names[j])})
            if not valid(cand):
                continue
            gain = len(_covers(cand, names) & uncovered) / (30 if cand["compile"] else 1)
            if gain > best_gain:
                best, best_gain = cand, gain
        uncovered -= _covers(best, names)
        rows.append(Combo(**best))
    # each refusal once on its own, otherwise plain options, so the matrix shows every reason
    plain = {n: v[0] for n, v in OPTIONS.items()}
    for alone in ({"labels": "derived", "cp": 2}, {"processor": "ce-sum", "main_grad": "declared",
                  "checkpoint": "region"}, {"defer_wgrad": True}):
        rows.append(Combo(**{**plain, **alone}))
    return rows


def _covers(cand: dict, names: list) -> set:
    """The pairs a row covers: all of them where it runs; where it is refused, only those that
    are refused whatever else is set (the others were not exercised)."""
    vals = [cand[n] for n in names]
    refused = expected_refusal(Combo(**cand)) is not None
    return {(i, vals[i], j, vals[j]) for i, j in itertools.combinations(range(len(names)), 2)
            if not refused or _refused_pair(names[i], vals[i], names[j], vals[j])}


def random_combos(n: int, seed: int) -> list[Combo]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        cand = {k: rng.choice(v) for k, v in OPTIONS.items()}
        if valid(cand):
            out.append(Combo(**cand))
    return out


# --------------------------------------------------------------------------- the data and the shards


def _data(c: Combo) -> dict:
    g = torch.Generator().manual_seed(1234)
    b, s = (1, sum(PADDED)) if c.packed else (B, S)
    d = dict(b=b, s=s)
    d["hidden"] = torch.randn(s, b, H, generator=g)
    d["weight"] = torch.randn(V, H, generator=g) * 0.5
    d["ids"] = torch.randint(0, V, (b, s), generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[0, 1] = -100
    d["labels"] = labels
    d["mask"] = (torch.rand(b, s, generator=g) > 0.3).float()
    n_samples = len(PADDED) if c.packed else b
    d["temps"] = torch.linspace(0.6, 1.4, n_samples)
    d["old"] = -torch.rand(b, s, generator=g) * 3
    d["adv"] = torch.randn(b, s, generator=g)
    d["w_out"] = torch.rand(b, s, generator=g)  # weights of per-token outputs in the test's loss
    # a kept set per position holding both the given label and the derived one (the next id)
    kept = torch.full((b, s, KEPT), -1, dtype=torch.long)
    nxt = d["ids"].roll(-1, dims=1)
    for i in range(b):
        for j in range(s):
            must = sorted({int(labels[i, j]), int(nxt[i, j])} - {-100})
            rest = [int(v) for v in torch.randperm(V, generator=g) if int(v) not in must]
            row = must + rest[: KEPT - len(must) - (j % 2)]  # some rows shorter (padding)
            kept[i, j, : len(row)] = torch.tensor(row)
    d["kept"] = kept
    d["teacher_ids"] = torch.randint(0, V, (b, s, TOP_K), generator=g)
    d["teacher_ids"][0, 0, -1] = -1  # padding
    d["teacher_lp"] = torch.log_softmax(torch.randn(b, s, TOP_K, generator=g), -1) - 0.5
    return d


def _packed_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
    cu_p = torch.tensor([0, *itertools.accumulate(PADDED)], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                           cu_seqlens_kv_padded=cu_p, max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED))


def _cp_positions(c: Combo, cp_rank: int) -> list[int]:
    """The sequence positions a CP rank holds: chunks r and 2cp-1-r of every (padded) sequence."""
    seqs = PADDED if c.packed else (S,)
    out, start = [], 0
    for length in seqs:
        chunk = length // (2 * c.cp)
        for k in (cp_rank, 2 * c.cp - 1 - cp_rank):
            out += range(start + k * chunk, start + (k + 1) * chunk)
        start += length
    return out


class _Model:
    """What a processor learns of the model through ``compute_language_model_loss``."""

    def __init__(self, cp_group: Any) -> None:
        self.cp_group = cp_group

    def compute_language_model_loss(self, labels, logits):  # pragma: no cover - never called
        raise NotImplementedError


def _processor(c: Combo, d: dict):
    from mcore_hooks import (
        EntropyProcessor,
        FusedLogprobProcessor,
        LinearCEProcessor,
        LogprobEntropyProcessor,
        PolicyLossProcessor,
    )
    from mcore_hooks import SelectedLogprobProcessor, TopKDistillationProcessor, Truncation
    from mcore_hooks.integrations import NemoRLLogprobProcessor, VerlFusedProcessor
    from mcore_hooks.kernels import PolicyLoss

    t = d["temps"] if c.temperature == "per-sample" else 0.8
    inv = dict(batch_invariant=c.invariant)
    if c.chunk_size != "default":
        inv["chunk_size"] = c.chunk_size
    up = UPSTREAM if c.main_grad == "declared" else None
    p = c.processor
    if p == "logprob":
        return FusedLogprobProcessor(**inv, temperature=t)
    if p == "entropy":
        return EntropyProcessor(**inv, temperature=t, mask_from_labels=True)
    plan = c.path == "plan"  # the plan takes tensors and tuples of tensors
    if p == "logprob-entropy":
        return LogprobEntropyProcessor(**inv, temperature=t, as_tuple=True)
    if p.startswith("ce-"):
        return LinearCEProcessor(**inv, reduction=p[3:], temperature=t, upstream_grad=up)
    if p.startswith("policy-"):
        return PolicyLossProcessor(**inv, aggregation=p[len("policy-"):], temperature=t, upstream_grad=up,
                                   as_tuple=plan)
    if p == "verl":
        return VerlFusedProcessor(**inv, as_tuple=plan)  # the temperature comes in the context
    if p == "kept-replay":
        return LogprobEntropyProcessor(**inv, temperature=t, as_tuple=True, kept_set="replay")
    if p == "kept-top-k":
        return FusedLogprobProcessor(**inv, temperature=t, kept_set=Truncation(top_k=6, top_p=0.9, min_p=0.01))
    if p == "kept-top-k-per-request":  # SGLang's rule, each sample (packed sequence) its own options
        return FusedLogprobProcessor(**inv, temperature=t, kept_set=Truncation(
            top_k=[5, -1], top_p=[0.85, 1.0], min_p=[0.0, 0.02], engine="sglang"))
    if p == "kept-mixed-widths":  # vLLM's rule: a top-k of 3 (its own width), vLLM's defaults (all)
        return FusedLogprobProcessor(**inv, temperature=t, kept_set=Truncation(top_k=[3, -1], top_p=[0.9, 1.0]))
    if p == "kept-policy":
        return PolicyLossProcessor(**inv, loss=PolicyLoss(entropy_coef=0.01), temperature=t, as_tuple=plan,
                                   kept_set="replay")
    if p == "selected":
        return SelectedLogprobProcessor(**inv, temperature=t)
    if p == "distill":  # NeMo RL's mixed KL, student full: every term, the entropy's tail too
        return TopKDistillationProcessor(**inv, temperature=t, as_tuple=plan, kl_type="mixed",
                                         renormalise="teacher", clamp_min=None)
    return NemoRLLogprobProcessor(**inv, temperature=t)


class _SimulatedFault(RuntimeError):
    """What a forward failing halfway raises here (an out-of-memory error would do the same)."""


class _FailsOnFourthCall:
    """The default policy loss as a per-token function that raises on its fourth call (its
    chunks' halves: the first chunks' gradients are in ``main_grad`` by then)."""

    def __init__(self) -> None:
        from mcore_hooks.kernels import PolicyLoss

        self.loss, self.calls = PolicyLoss(), 0
        self.needs_entropy, self.input_names = self.loss.needs_entropy, self.loss.input_names

    def __call__(self, logprob, entropy, **inputs):
        self.calls += 1
        if self.calls == 4:
            raise _SimulatedFault("simulated: the forward failed halfway")
        return self.loss(logprob, entropy, **inputs)


def _fault_then_clear(c: Combo, d: dict, kwargs: dict, hidden, weight) -> Optional[str]:
    """``c.fault``: the declared forward failing halfway must raise, warn that
    ``main_grad`` is now NaN and leave it NaN (nothing takes a partial sum back exactly);
    ``main_grad`` is then cleared for the retry, which must be exact. What went otherwise, or
    None (also where the combination is refused: the retry is refused the same way)."""
    import warnings

    from mcore_hooks import PolicyLossProcessor

    proc = _processor(c, d)
    failing = PolicyLossProcessor(loss=_FailsOnFourthCall(), aggregation=proc.aggregation,
                                  temperature=proc.temperature, chunk_size=proc.chunk_size,
                                  batch_invariant=proc.batch_invariant, upstream_grad=proc.upstream_grad,
                                  as_tuple=proc.as_tuple)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            failing(hidden_states=hidden, **kwargs)
        except (ValueError, TypeError, NotImplementedError) as e:
            if expected_refusal(c) is None:  # not a refusal the combination calls for
                return f"fault: the failing call was refused unexpectedly: {type(e).__name__}: {e}"
            return None  # refused before it ran: so is the retry, and check() wants that
        except _SimulatedFault:
            pass
        else:
            return "fault: the failing loss did not fail (one chunk only?)"
    if not any("now NaN" in str(w.message) for w in seen):
        return f"fault: no warning that main_grad is now NaN ({[str(w.message) for w in seen]})"
    if not torch.isnan(weight.main_grad).all():
        return "fault: main_grad left partly added, not NaN"
    weight.main_grad.zero_()
    hidden.grad = weight.grad = None
    return None


def _outputs(c: Combo, out: Any) -> tuple:
    """What the processor returned as a tuple of tensors, in one order for both paths."""
    p = c.processor
    if (p.startswith("policy-") or p == "kept-policy") and isinstance(out, dict):
        return out["loss"], out["logprobs"], out["entropy"]
    if p == "distill" and isinstance(out, dict):
        return out["loss"], out["kl"]
    if p == "verl" and not isinstance(out, tuple):
        return out.log_probs, out.entropy
    return out if isinstance(out, tuple) else (out,)


def _loss(c: Combo, outs: tuple, w_out: torch.Tensor, mtp: Optional[torch.Tensor]) -> torch.Tensor:
    """The scalar the test backpropagates: the reduced loss times UPSTREAM, or a weighted sum of
    the per-token outputs (the weights sliced like the outputs; the second output left out
    where the loss uses the first only), plus the MTP depths' loss."""
    p = c.processor
    second = c.uses == "all"
    if p in ("ce-sum", "ce-mean", "kept-policy", "distill") or p.startswith("policy-"):
        loss = outs[0] * UPSTREAM
    elif p in ("logprob-entropy", "kept-replay"):
        loss = (outs[0] * w_out).sum() + (0.3 * (outs[1] * w_out).sum() if second else 0.0)
    elif p == "verl":
        w = w_out.reshape(-1)
        loss = (outs[0] * w).sum() + (0.3 * (outs[1] * w).sum() if second else 0.0)
    elif p == "nemo-rl":
        loss = (outs[0] * w_out[:, :-1]).sum()
    elif p == "selected":
        loss = (outs[0] * w_out.unsqueeze(-1) * torch.linspace(0.5, 1.0, TOP_K)).sum()
    else:
        loss = (outs[0] * w_out).sum()
    if mtp is None:
        return loss
    # NeMo RL's processor hands every CP rank the whole sequences' loss (its gradient counts cp
    # times once summed over ranks, which check() allows for): the MTP term likewise
    return loss + 0.2 * mtp * (c.cp if p == "nemo-rl" else 1)


def _mtp_loss(c: Combo, d: dict, hidden, weight, layer, config, tp_group, tp_rank, pos) -> Optional[torch.Tensor]:
    """The MTP depths' fused loss on the same output weight (each depth's hidden states a
    multiple of the main head's, its labels the main labels rolled), summed."""
    if not c.mtp:
        return None
    from mcore_hooks.mtp import MTPDepth, fused_mtp_loss

    total = 0.0
    tp_rank = tp_rank if c.tp > 1 else 0  # an unsplit vocabulary: the whole of it on every rank
    for k in range(1, c.mtp + 1):
        labels = d["labels"].roll(-k, dims=1)[:, pos]
        depth = MTPDepth(hidden * (1.0 + 0.5 * k), labels, weight, layer, 1.0, k, c.mtp, config,
                         tp_group if c.tp > 1 else None, tp_rank, c.tp, tp_rank * (V // c.tp), c.sp)
        total = total + (fused_mtp_loss(depth, backend="torch").loss * d["w_out"][:, pos]).sum()
    return total


def run(c: Combo, tp_group: Any, tp_rank: int, cp_group: Any, cp_rank: int) -> dict:
    """The processor on this rank's shard of the combination; what it returned and the
    gradients, or the refusal's message."""
    d = _data(c)
    full = c.tp == 1 and c.cp == 1
    pos = list(range(d["s"])) if c.cp == 1 else _cp_positions(c, cp_rank)
    hidden = d["hidden"][pos]
    if c.sp:
        hidden = hidden.chunk(c.tp)[tp_rank]
    hidden = hidden.clone().requires_grad_()
    v_local = V // c.tp
    rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local) if c.tp > 1 else slice(None)
    weight = torch.nn.Parameter(d["weight"][rows].clone())
    layer = torch.nn.Module()
    layer.tp_group, layer.sequence_parallel = (tp_group if c.tp > 1 else None), c.sp
    if c.tied:
        layer.weight = None  # the embedding's weight arrives as output_weight
    else:
        layer.weight = weight
    config = types.SimpleNamespace(context_parallel_size=c.cp, gradient_accumulation_fusion=c.main_grad != "off")
    hook = None
    if c.main_grad != "off":
        hook = ddp_like(weight)
    labels = d["ids"] if c.processor == "nemo-rl" else d["labels"]
    context: Any = None
    if c.processor.startswith("policy-") or c.processor == "kept-policy":
        context = {"old_logprobs": d["old"][:, pos], "advantages": d["adv"][:, pos]}
        if c.processor == "kept-policy":
            context["sampling_mask"] = d["kept"][:, pos]
    elif c.processor == "kept-replay":
        context = {"sampling_mask": d["kept"][:, pos]}
    elif c.processor in ("selected", "distill"):
        context = {"teacher_ids": d["teacher_ids"][:, pos], "teacher_logprobs": d["teacher_lp"][:, pos],
                   "selected_ids": d["teacher_ids"][:, pos]}
    elif c.processor == "verl":
        from mcore_hooks.integrations import FusedOutputProcessorContext

        context = FusedOutputProcessorContext(temperature=d["temps"] if c.temperature == "per-sample" else 0.8)
    model = _Model(cp_group if c.cp > 1 else None)
    if c.defer_wgrad:  # a pipeline stage whose output layer defers its weight gradient
        layer.config = types.SimpleNamespace(defer_embedding_wgrad_compute=True)
        layer.embedding_activation_buffer = []
    kwargs = dict(
        output_layer=layer, output_weight=weight if c.tied else None,
        labels=labels[:, pos] if (c.labels == "given" or c.processor == "nemo-rl") else None,
        loss_mask=d["mask"][:, pos] if c.loss_mask else None, input_ids=d["ids"][:, pos],
        position_ids=None, attention_mask=None, decoder_input=None, inference_context=None,
        packed_seq_params=_packed_params() if c.packed else None, runtime_gather_output=None,
        context=context, compute_language_model_loss=model.compute_language_model_loss,
        scale_logits=lambda logits: logits, config=config,
    )
    if c.fault:
        problem = _fault_then_clear(c, d, kwargs, hidden, weight)
        if problem:
            if hook is not None:
                hook.remove()
            return {"fault": problem}
    processor = _processor(c, d)
    first: list = []

    def call(h):
        outs = _outputs(c, processor(hidden_states=h, **kwargs))
        mtp = _mtp_loss(c, d, h, weight, layer, config, tp_group, tp_rank, pos)
        if not first:  # the forward's own results (a checkpoint's recomputation runs it again)
            first.append((outs, mtp))
        return outs if mtp is None else (*outs, mtp)

    if c.compile:  # torch.compile around the call (graph breaks allowed, as a trainer compiles)
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager")
    w_out = d["w_out"] if c.processor == "nemo-rl" else d["w_out"][:, pos]
    try:
        try:
            if c.checkpoint == "region":
                flat = torch.utils.checkpoint.checkpoint(call, hidden, use_reentrant=False)
            else:
                flat = call(hidden)
        except (ValueError, TypeError, NotImplementedError) as e:
            untouched = hidden.grad is None and weight.grad is None and (
                c.main_grad == "off" or not weight.main_grad.any())
            return {"refused": f"{type(e).__name__}: {e}", "untouched": untouched}
        outs, mtp = (flat[:-1], flat[-1]) if c.mtp else (flat, None)
        if c.path == "plan":
            # the plan's loss node: the loss of detached leaves, each output's .grad handed back
            # (None where unused), then the post-process node's backward over the outputs
            from mcore_hooks.schedule_plan import post_process_backward

            leaves = [o.detach().requires_grad_(o.requires_grad) for o in flat]
            lv = leaves[:-1] if c.mtp else leaves
            _loss(c, tuple(lv), w_out, leaves[-1] if c.mtp else None).backward()
            post_process_backward(tuple(flat), tuple(leaf.grad for leaf in leaves))
        else:
            _loss(c, outs, w_out, mtp).backward()
        out = first[0][0]
    finally:
        if hook is not None:
            hook.remove()
    dw = weight.main_grad if c.main_grad != "off" else weight.grad
    dw = dw.clone()
    if c.cp > 1:
        torch.distributed.all_reduce(dw, group=cp_group)
    if c.tp > 1:  # the whole weight's gradient from the shards
        parts = [torch.empty_like(dw) for _ in range(c.tp)]
        torch.distributed.all_gather(parts, dw.contiguous(), group=tp_group)
        dw = torch.cat(parts)
    dh = hidden.grad
    if c.sp:
        parts = [torch.empty_like(dh) for _ in range(c.tp)]
        torch.distributed.all_gather(parts, dh.contiguous(), group=tp_group)
        dh = torch.cat(parts)
    values = [o.detach() for o in out] + ([first[0][1].detach()] if c.mtp else [])
    return {"values": values, "dh": dh, "dw": dw, "pos": pos, "full": full}


def check(c: Combo, got: dict, ref: dict) -> Optional[str]:
    """None where ``got`` (this rank's run) matches ``ref`` (the unsplit run); else what differs.
    float32 sums of a few tens of O(1) terms in another order: 1e-5 relative, 1e-6 absolute."""
    want = expected_refusal(c)
    if "fault" in got:
        return got["fault"]
    if "refused" in got:
        if want is None:
            return f"refused unexpectedly: {got['refused']}"
        import re

        if not re.search(want, got["refused"]):
            return f"refused with another error: {got['refused']}"
        if not got["untouched"]:
            return "refused after writing a gradient"
        return None
    if want is not None:
        return f"ran; expected a refusal matching {want!r}"
    pos = got["pos"]
    reduced = c.processor in REDUCED or c.processor.startswith("policy-")
    per_token = not reduced
    values, ref_values = got["values"], ref["values"]
    if c.mtp:  # the depths' loss summed over this rank's tokens: whole only without CP
        (mtp, *values), (mtp_ref, *ref_values) = values[-1:] + values[:-1], ref_values[-1:] + ref_values[:-1]
        if c.cp == 1 and not torch.allclose(mtp, mtp_ref, rtol=1e-5, atol=1e-6):
            return f"MTP loss differs: {float((mtp - mtp_ref).abs())}"
    for i, (a, r) in enumerate(zip(values, ref_values)):
        if c.processor == "verl":
            r = r.view(-1, len(ref["pos"]))[:, pos].reshape(-1)
        elif per_token or (reduced and c.processor != "nemo-rl" and i > 0):
            r = r[:, pos]
        if a.shape != r.shape or not torch.allclose(a, r, rtol=1e-5, atol=1e-6):
            return f"value {i} differs: {float((a - r).abs().max()) if a.shape == r.shape else (a.shape, r.shape)}"
    scale = c.cp if c.processor == "nemo-rl" else 1  # NeMo RL's gather: every CP rank's loss
    dh_ref = ref["dh"][pos] * scale
    if not torch.allclose(got["dh"], dh_ref, rtol=1e-5, atol=1e-6):
        return f"hidden-state gradient differs: {float((got['dh'] - dh_ref).abs().max())}"
    if not torch.allclose(got["dw"], ref["dw"] * scale, rtol=1e-5, atol=1e-6):
        return f"weight gradient differs: {float((got['dw'] - ref['dw'] * scale).abs().max())}"
    return None


def reference_of(c: Combo) -> Combo:
    """The same processor and options on the unsplit batch (no TP, SP or CP), through the plain
    path (the loss's backward, no checkpointed region)."""
    return dataclasses.replace(c, tp=1, sp=False, cp=1, path="forward", checkpoint="none", compile=False, fault=False,
                               labels="given" if c.labels == "derived" and c.cp > 1 else c.labels)


def run_all(combos: list[Combo]) -> list[tuple[Combo, Optional[str], Optional[str]]]:
    """On each of 4 ranks (TP 2 x CP 2): every combination, and its reference; per combination,
    what differs (None: matches) and the refusal (None: ran). The reference (the unsplit batch,
    the same on every rank) is computed by one rank, in turn, and sent to the others: the ranks
    share two cores, and four copies of it took half the run."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for i, c in enumerate(combos):
        got = run(c, tp_group, tp_rank, cp_group, cp_rank)
        ref = {}
        if not expected_refusal(c):
            box = [run(reference_of(c), None, 0, None, 0) if rank == i % world else None]
            dist.broadcast_object_list(box, src=i % world)
            ref = box[0]
        if "refused" in ref:
            problem = f"the unsplit reference was refused: {ref['refused']}"
        else:
            problem = check(c, got, ref)
        results.append((c, problem, got.get("refused")))
    return results


def table(rows: list[tuple[Combo, Optional[str], Optional[str]]]) -> str:
    """The docs' matrix: one line per combination, exact or refused and why."""
    lines = ["| processor | TP | SP | CP | layout | tied | temperature | labels | loss mask | main_grad "
             "| path | loss uses | checkpoint | MTP | deferred wgrad | batch-invariant | compiled | chunk_size "
             "| fault, then retry | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, problem, refused in rows:
        result = ("**FAILS**: " + problem) if problem else (
            f"refused: `{refused.split(':', 1)[1].strip()[:90]}...`"
            if refused else "exact")
        lines.append(
            f"| {c.processor} | {c.tp} | {'on' if c.sp else 'off'} | {c.cp} | {'THD' if c.packed else 'BSHD'} | "
            f"{'yes' if c.tied else 'no'} | {c.temperature} | {c.labels} | {'yes' if c.loss_mask else 'no'} | "
            f"{c.main_grad} | {c.path} | {c.uses} | {c.checkpoint} | {c.mtp} | "
            f"{'yes' if c.defer_wgrad else 'no'} | {'yes' if c.invariant else 'no'} | "
            f"{'yes' if c.compile else 'no'} | {c.chunk_size} | {'yes' if c.fault else 'no'} | {result} |")
    return "\n".join(lines)


def merged(per_rank: list) -> list[tuple[Combo, Optional[str], Optional[str]]]:
    """One row per combination from every rank's results: the first rank's problem, if any."""
    rows = []
    for i, (c, _, refused) in enumerate(per_rank[0]):
        problems = [f"rank {rank}: {r[i][1]}" for rank, r in enumerate(per_rank) if r[i][1]]
        rows.append((c, problems[0] if problems else None, refused))
    return rows


README_START, README_END = "<!-- configuration-space:start -->", "<!-- configuration-space:end -->"


def readme_table() -> str:
    """The matrix as docs/testing.md shows it (between the markers)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text()
    return text[text.index(README_START) + len(README_START):text.index(README_END)].strip()


if __name__ == "__main__":
    import sys

    from mcore_hooks.testing import run_on_ranks

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    print(table(merged(run_on_ranks(run_all, 4, covering_set(), tp=2, cp=2, timeout=900))))
