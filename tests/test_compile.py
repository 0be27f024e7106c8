"""torch.compile and the kernels' custom ops, on the CPU (the torch backend; the Triton backend
and CUDA graphs are in ``test_gpu.py``).

``backend="aot_eager"`` runs Dynamo (``fullgraph=True``: any graph break is an error) and
AOTAutograd (the ops' fake implementations, their registered autograd, the backward traced) but
no code generation, so the CPU suite needs no compiler. The ops' own implementations are the
eager code, so the values are the eager ones; the few float32 operations around them (the
processors' reshapes, masks and sums) may be reordered: 1e-6 relative to the O(1) terms."""

from __future__ import annotations

import pytest
import torch

from mcore_hooks import (
    EntropyProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
    PolicyLossProcessor,
    SelectedLogprobProcessor,
    TopKDistillationProcessor,
    Truncation,
)
from mcore_hooks.integrations import NemoRLLogprobProcessor, VerlFusedProcessor
from mcore_hooks.integrations.verl import FusedOutputProcessorContext
from mcore_hooks.kernels import PolicyLoss, linear_cross_entropy, linear_logprob_entropy, linear_policy_loss
from mcore_hooks.kernels.passes import candidates_op, loss_op, stats_op
from mcore_hooks.testing import hook_keywords


B, S, H, V = 2, 16, 8, 30


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return layer, hidden, labels, mask


def _scalar(out):
    """One differentiable number from whatever a processor returns."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.dim() else out
    if hasattr(out, "log_probs"):  # verl's output
        return out.log_probs.sum() + 0.5 * out.entropy.sum()
    if isinstance(out, dict):
        return sum(_scalar(v) * (i + 1) for i, v in enumerate(out.values())
                   if isinstance(v, torch.Tensor) and v.requires_grad)
    return sum(_scalar(v) * (i + 1) for i, v in enumerate(out) if v is not None and v.requires_grad)


T_ROWS = torch.tensor([0.7, 1.3])
CASES = {
    "fused-logprob": (lambda: FusedLogprobProcessor(backend="torch"), None),
    "fused-logprob-per-sample-T": (lambda: FusedLogprobProcessor(backend="torch", temperature=T_ROWS), None),
    "entropy": (lambda: EntropyProcessor(backend="torch"), None),
    "logprob-entropy-per-sample-T": (lambda: LogprobEntropyProcessor(backend="torch", temperature=T_ROWS), None),
    "logprob-entropy-tuple": (lambda: LogprobEntropyProcessor(backend="torch", as_tuple=True), None),
    "linear-ce-sum": (lambda: LinearCEProcessor(backend="torch"), None),
    "linear-ce-mean": (lambda: LinearCEProcessor(backend="torch", reduction="mean"), None),
    "policy": (lambda: PolicyLossProcessor(backend="torch"), "policy"),
    "policy-kl-entropy-seq-mean": (lambda: PolicyLossProcessor(
        loss=PolicyLoss(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0), backend="torch",
        aggregation="seq-mean-token-mean"), "policy-kl"),
    "verl": (lambda: VerlFusedProcessor(backend="torch"), "verl"),
    "nemo-rl": (lambda: NemoRLLogprobProcessor(temperature=0.7, backend="torch"), "nemo"),
    "kept-set-replay": (lambda: LogprobEntropyProcessor(kept_set="replay", temperature=T_ROWS), "kept"),
    "kept-set-truncation": (lambda: FusedLogprobProcessor(
        kept_set=Truncation(top_k=6, top_p=0.9, min_p=0.02), temperature=0.8), None),
    "kept-set-policy": (lambda: PolicyLossProcessor(kept_set="replay", backend="torch"), "policy-kept"),
    "selected-ids": (lambda: SelectedLogprobProcessor(with_label=True, backend="torch"), "teacher"),
    "top-k-distillation": (lambda: TopKDistillationProcessor(backend="torch"), "teacher"),
}


def _kept_rows(labels, g):
    """A kept set per position: the label and 4 other distinct ids."""
    rows = []
    for y in labels.reshape(-1).tolist():
        others = [v for v in torch.randperm(V, generator=g).tolist() if v != y][:4]
        rows.append([y] + others)
    return torch.tensor(rows).view(*labels.shape, 5)


def _context(kind, g):
    if kind in ("policy", "policy-kl"):
        ctx = {"old_logprobs": -torch.rand(B, S, generator=g) * 3, "advantages": torch.randn(B, S, generator=g)}
        if kind == "policy-kl":
            ctx["ref_logprobs"] = -torch.rand(B, S, generator=g) * 3
        return ctx
    if kind == "verl":
        return FusedOutputProcessorContext(temperature=0.9)
    if kind == "teacher":
        ids = torch.randint(0, V, (B, S, 4), generator=g)
        return {"teacher_ids": ids, "selected_ids": ids,
                "teacher_logprobs": torch.log_softmax(torch.randn(B, S, 4, generator=g), -1)}
    return None


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_every_processor_compiles_whole(case, dynamic):
    """``torch.compile(fullgraph=True)`` around each bundled processor and both integrations:
    no graph break, and the eager values and gradients (hidden states and weight); with
    ``dynamic=True`` too, where every size and float option is symbolic (a finiteness check by
    ``math.isfinite`` refused a symbolic temperature)."""
    make, kind = CASES[case]
    layer, hidden, labels, mask = _data()
    context = _context(kind, torch.Generator().manual_seed(2))
    if kind in ("kept", "policy-kept"):
        context = {**(_context("policy", torch.Generator().manual_seed(2)) if kind == "policy-kept" else {}),
                   "sampling_mask": _kept_rows(labels, torch.Generator().manual_seed(4))}
    extra = dict(input_ids=labels) if kind == "nemo" else dict(loss_mask=mask)

    # what the model hands the hook, and the processor, are made outside the compiled step
    keywords = hook_keywords(hidden, layer, labels=labels, context=context, **extra)
    processor = make()

    def step(h):
        return _scalar(processor(**{**keywords, "hidden_states": h}))

    torch._dynamo.reset()
    results = []
    for run in (step, torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")):
        h = hidden.clone().requires_grad_()
        layer.zero_grad()
        out = run(h)
        out.backward()
        results.append((out.detach(), h.grad, layer.weight.grad.clone()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_a_python_loss_function_compiles_with_a_graph_break():
    """A per-token loss written as a Python function cannot be an op argument: it keeps the
    autograd-Function path, which compiles with a graph break (and gives the eager values)."""
    layer, hidden, labels, mask = _data()
    adv = torch.randn(B * S)

    def step(h):
        r = linear_policy_loss(h.reshape(-1, H), layer.weight, labels.t().reshape(-1),
                               token_weight=mask.t().reshape(-1), backend="torch",
                               loss=lambda lp, ent, advantages: -advantages * lp,
                               inputs={"advantages": adv})
        return r.loss

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    results = []
    for run in (step, compiled):
        h = hidden.clone().requires_grad_()
        out = run(h)
        out.backward()
        results.append((out.detach(), h.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="(?i)graph break|autograd|Unsupported"):
        torch._dynamo.reset()
        torch.compile(step, fullgraph=True, backend="aot_eager")(hidden.clone().requires_grad_())


def _op_samples():
    torch.manual_seed(3)
    n, h, v = 6, 4, 10
    x = torch.randn(n, h, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(v, h).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[2] = -100
    valid = labels != -100
    coef = torch.full((n,), 1.25)
    common = (x, w, labels, valid, coef, 0, None, False, 4, "torch")
    pl = loss_op.policy_loss_data(PolicyLoss(kl_coef=0.1, entropy_coef=0.05))
    inputs = [-torch.rand(n), torch.randn(n), -torch.rand(n)]
    acc = torch.zeros(v, h)
    stats = stats_op.logsoftmax_stats(*[a.detach() if torch.is_tensor(a) else a for a in common], None, False)
    m, log_s, entropy = stats[4], stats[5], stats[1]
    backward = (x.detach(), w.detach(), labels, valid, coef, 0, None, False, 4, "torch", m, log_s,
                entropy, torch.randn(n), torch.randn(n), True, True)
    ids = torch.randint(-1, v, (n, 3))
    cand = (x, w, ids, coef, 0, None, False, 4)
    cand_backward = (x.detach(), w.detach(), ids, coef, 0, None, False, 4, torch.randn(n, 3), True, True)
    return {
        "candidate_logits": (candidates_op.candidate_logits, cand + (None, False, "torch")),
        "candidate_logits-accumulator-invariant": (candidates_op.candidate_logits,
                                                   cand + (acc, True, "torch+invariant")),
        "candidate_logits_backward": (candidates_op.candidate_logits_backward, cand_backward + (None, False)),
        "candidate_logits_backward-accumulator": (candidates_op.candidate_logits_backward,
                                                  cand_backward + (acc.clone(), False)),
        "top_k_ids": (candidates_op.top_k_ids, (x.detach(), w.detach(), coef, 0, None, False, 4, 3, False)),
        "top_k_ids-invariant": (candidates_op.top_k_ids, (x.detach(), w.detach(), coef, 0, None, False, 4, 3, True)),
        "logsoftmax_stats-invariant": (stats_op.logsoftmax_stats, common[:-1] + ("torch+invariant", None, False)),
        "logsoftmax_stats": (stats_op.logsoftmax_stats, common + (None, False)),
        "logsoftmax_stats-extra-ids": (stats_op.logsoftmax_stats, common + (None, False, ids)),
        "logsoftmax_stats_backward-extra-ids": (stats_op.logsoftmax_stats_backward,
                                                backward + (None, ids, torch.randn(n, 3), torch.randn(n, 3))),
        "logsoftmax_stats-accumulator": (stats_op.logsoftmax_stats, common + (acc, True)),
        "logsoftmax_stats_backward": (stats_op.logsoftmax_stats_backward, backward + (None,)),
        "logsoftmax_stats_backward-accumulator": (stats_op.logsoftmax_stats_backward, backward + (acc.clone(),)),
        "fused_token_loss-nll": (loss_op.fused_token_loss, common + (torch.rand(n), None, [], True, True,
                                                               None, False, False)),
        "fused_token_loss-policy": (loss_op.fused_token_loss, common + (torch.rand(n), pl, inputs, True, True,
                                                                  None, False, False)),
        "fused_token_loss-accumulator": (loss_op.fused_token_loss, common + (torch.rand(n), pl, inputs, True,
                                                                       True, acc.clone(), True, False)),
        # an op without autograd (its autograd.Function wraps it): called on detached inputs
        "fused_token_loss_into_": (loss_op.fused_token_loss_into_, (x.detach(), w.detach()) + common[2:]
                                   + (acc.clone(), 0.5, torch.rand(n), pl, inputs, True, True)),
    }


@pytest.mark.parametrize("name", list(_op_samples()))
def test_ops_pass_torch_library_opcheck(name):
    """``torch.library.opcheck``: the schema matches what the op does (no undeclared mutation
    or aliasing; the accumulator forms write only what they declare), the fake implementation
    matches the real one's outputs, the registered autograd is reached, and AOTAutograd traces
    it. (The collectives, ``all_reduce_`` and ``reduce_scatter_tokens``, need a process group:
    the TP tests run them.)"""
    op, args = _op_samples()[name]
    torch.library.opcheck(op, args)


def test_the_op_path_is_the_eager_path_bit_for_bit():
    """The entry points go through the ops: calling the kernels twice gives identical bits, and
    the compiled call (its ops run the same code) too, for the log-prob pass and the loss."""
    layer, hidden, labels, _ = _data()
    x = hidden.reshape(-1, H)
    flat = labels.t().reshape(-1)

    def both(xx):
        r = linear_logprob_entropy(xx, layer.weight, flat, backend="torch")
        return r.logprob, r.entropy, linear_cross_entropy(xx, layer.weight, flat, backend="torch")

    torch._dynamo.reset()
    eager = both(x)
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")(x)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def _traced_graphs(fn, *args):
    """``fn(*args)`` compiled and backpropagated; the forward and backward graphs AOTAutograd
    traced (no code generated)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(*args)
    out.backward()
    return graphs


def _targets(graphs):
    """The functions the graphs call, a mutating op by its name (not its functional wrapper)."""
    return {str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
            for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("entry", ["logprob", "policy-loss", "policy-loss-declared"])
def test_a_traced_backward_calls_the_ops_not_their_eager_code(entry, monkeypatch):
    """Up to torch 2.11, AOTAutograd traced the ops' autograd formulas with fake tensors while
    ``torch.compiler.is_compiling()`` was False (later releases hold it True for the whole
    compile session; undone here, to trace as 2.11 does). The formulas ran the ops' eager code
    there, which on a GPU read a fake tensor's data pointer ("Cannot access data pointer of
    Tensor": every processor under Inductor, H200, torch 2.11) and on the CPU was traced into
    plain torch operations. The backward graph now holds the ops themselves."""
    import contextlib

    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    layer, hidden, labels, _ = _data()
    x = hidden.reshape(-1, H).detach().requires_grad_()
    w = layer.weight.detach().requires_grad_()
    flat = labels.t().reshape(-1)
    n = flat.shape[0]
    acc = torch.zeros(V, H)

    def fn(xx, ww):
        if entry == "logprob":
            return linear_logprob_entropy(xx, ww, flat, backend="torch").logprob.sum()
        return linear_policy_loss(
            xx, ww, flat, token_weight=torch.ones(n), backend="torch",
            inputs={"advantages": torch.linspace(-1, 1, n), "old_logprobs": -torch.ones(n)},
            **({"weight_grad_accumulator": acc, "upstream_grad": 1.0} if entry.endswith("declared") else {})).loss

    targets = _targets(_traced_graphs(fn, x, w))
    op = {"logprob": "mcore_hooks.logsoftmax_stats_backward.default",
          "policy-loss": "mcore_hooks.fused_token_loss.default",
          "policy-loss-declared": "mcore_hooks.fused_token_loss_into_.default"}[entry]
    assert op in targets, sorted(targets)
    if entry == "logprob":  # the backward's own op, not its implementation's torch operations
        assert not any("mm" in t and "mcore_hooks" not in t for t in targets), sorted(targets)


class _Capture:
    def __init__(self):
        self.kwargs = None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        return kwargs["hidden_states"].sum()


@pytest.mark.usefixtures("mp1")
@pytest.mark.parametrize("main_grad", [False, True, "declared"], ids=["grad", "main-grad", "declared"])
def test_keywords_from_a_megatron_model_compile_whole(main_grad):
    """The keywords as a stock Megatron Core forward hands them (its output layer, its bound
    ``scale_logits``, its config), with ``gradient_accumulation_fusion`` and the weight as
    Megatron DDP holds it (a float32 ``main_grad``, ``grad_added_to_main_grad = False``, DDP's
    hook asserting a ``.grad``): the weight's gradient added into ``main_grad`` in the op's
    backward (or, with a declared ``upstream_grad``, in the policy loss's forward), the weight
    marked (eager) and DDP's hook run once per backward, in two compiled runs as in the eager
    ones: a compiled backward is traced once and replays no Python side effect, so there the
    hand-off gives DDP a gradient to add instead of marking the weight (before, the weight got
    no gradient at all); whole graph, the eager values, hidden-state gradient and
    ``main_grad``."""
    from ddp_like import ddp_like

    from mcore_hooks import hooked_class
    from mcore_hooks.testing import TinyModelConfig, build_tiny_model, stock_model_class, tiny_batch

    cfg = TinyModelConfig(tied=False)
    model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(cfg.model_class)))
    batch = tiny_batch(cfg)
    cap = _Capture()
    with torch.no_grad():
        model(**batch, output_processor=cap)
    keywords = dict(cap.kwargs)
    weight = model.output_layer.weight
    ddp = None
    if main_grad:
        keywords["config"].gradient_accumulation_fusion = True
        ddp = ddp_like(weight)
    hidden = keywords["hidden_states"].detach()
    if main_grad == "declared":
        g = torch.Generator().manual_seed(5)
        b, s = batch["labels"].shape
        keywords["context"] = {"old_logprobs": -torch.rand(b, s, generator=g),
                               "advantages": torch.randn(b, s, generator=g)}
        processor = PolicyLossProcessor(backend="torch", upstream_grad=1.0)

        def step(h):
            return processor(**{**keywords, "hidden_states": h})["loss"]
    else:
        processor = LogprobEntropyProcessor(backend="torch", temperature=0.9)

        def step(h):
            out = processor(**{**keywords, "hidden_states": h})
            return out["logprobs"].sum() + 0.5 * out["entropy"].sum()

    torch._dynamo.reset()
    results = []
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    try:
        for run in (step, step, compiled, compiled):
            h = hidden.clone().requires_grad_()
            weight.grad = None
            if ddp is not None:
                ddp.zero_grad_buffer()
            out = run(h)
            out.backward()
            if ddp is not None:  # DDP's hook once a backward; eager, the weight marked
                assert ddp.calls == 1 and weight.grad is None
                assert run is compiled or weight.grad_added_to_main_grad
            w_grad = weight.main_grad.clone() if main_grad else weight.grad.clone()
            results.append((out.detach(), h.grad, w_grad))
    finally:
        if main_grad:
            keywords["config"].gradient_accumulation_fusion = False
            ddp.remove()
            for name in ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad"):
                delattr(weight, name)
    for eager, compiled_result in zip(results[0], results[2]):
        torch.testing.assert_close(compiled_result, eager, rtol=1e-6, atol=1e-6)
    for first, second in zip(results[2], results[3]):
        assert torch.equal(first, second)


def test_the_ops_outputs_that_carry_no_gradient_are_detached():
    """Through the ops, as through the autograd Functions before them: the policy loss's
    per-token log-probs and entropies are detached (metrics), and so is the log-prob pass's
    ``logz``; the log-prob and entropy of that pass carry gradients."""
    layer, hidden, labels, mask = _data()
    x = hidden.reshape(-1, H).requires_grad_()
    y = labels.t().reshape(-1)
    r = linear_policy_loss(x, layer.weight, y, token_weight=mask.t().reshape(-1), backend="torch",
                           inputs={"old_logprobs": torch.zeros(B * S), "advantages": torch.ones(B * S)})
    assert r.loss.requires_grad and not r.logprob.requires_grad and not r.entropy.requires_grad
    s = linear_logprob_entropy(x, layer.weight, y, backend="torch")
    assert s.logprob.requires_grad and s.entropy.requires_grad and not s.logz.requires_grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("ddp", [False, True], ids=["user-main_grad", "ddp-flags"])
def test_the_main_grad_hand_off_compiled_keeps_a_gradient_from_another_op(ddp, backend):
    """A subclass may use the routed weight (``kernel_inputs().weight``) in an op of its own
    beside the kernels: that op's gradient goes into ``main_grad`` (with DDP's flags, compiled:
    handed to DDP, which adds it). Without DDP the hand-off's write to ``main_grad`` is a
    declared mutation: ordered after the kernels' own additions and never dropped as dead code
    (it was lost, 2w here, both ways)."""
    import types

    from ddp_like import ddp_like

    from mcore_hooks import main_grad as mg

    v, h, n = 30, 8, 10
    g = torch.Generator().manual_seed(0)
    w0, x, y = torch.randn(v, h, generator=g), torch.randn(n, h, generator=g), torch.randint(0, v, (n,), generator=g)
    cfg = types.SimpleNamespace(gradient_accumulation_fusion=True)
    ref = w0.clone().requires_grad_()
    (linear_logprob_entropy(x, ref, y, backend="torch").logprob.sum() + (ref ** 2).sum()).backward()
    weight = torch.nn.Parameter(w0.clone())
    hook = ddp_like(weight) if ddp else None
    if not ddp:
        weight.main_grad = torch.zeros(v, h)

    def step(hh):
        routed, kw = mg.main_grad_route(weight, cfg)
        return linear_logprob_entropy(hh, routed, y, backend="torch", **kw).logprob.sum() + (routed ** 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for _ in range(2):
        weight.main_grad.zero_()
        if hook is not None:
            hook.zero_grad_buffer()
        compiled(x.clone()).backward()
        torch.testing.assert_close(weight.main_grad, ref.grad, rtol=1e-6, atol=1e-6)
        assert weight.grad is None and (not ddp or hook.calls == 1)


@pytest.mark.parametrize("ddp", [False, True], ids=["user-main_grad", "ddp-flags"])
def test_main_grad_compiled_inside_saved_tensor_hooks_is_refused(ddp):
    """Inside saved-tensor hooks (``save_on_cpu``, activation offloading) a compiled graph saves
    ``main_grad`` through the hooks, and the kernels' backward added the weight's gradient into a
    copy: lost, with the weight still marked for DDP. Refused in the forward, before anything is
    added; eager, which keeps ``main_grad`` out of the saved tensors, stays exact there."""
    import types

    from ddp_like import ddp_like

    from mcore_hooks import main_grad as mg

    v, h, n = 30, 8, 10
    g = torch.Generator().manual_seed(1)
    w0, x, y = torch.randn(v, h, generator=g), torch.randn(n, h, generator=g), torch.randint(0, v, (n,), generator=g)
    cfg = types.SimpleNamespace(gradient_accumulation_fusion=True)
    ref = w0.clone().requires_grad_()
    linear_logprob_entropy(x, ref, y, backend="torch").logprob.sum().backward()
    weight = torch.nn.Parameter(w0.clone())
    if ddp:
        ddp_like(weight)
    else:
        weight.main_grad = torch.zeros(v, h)

    def step(hh):
        routed, kw = mg.main_grad_route(weight, cfg)
        return linear_logprob_entropy(hh, routed, y, backend="torch", **kw).logprob.sum()

    def offload(t):
        return t.detach().clone()  # what save_on_cpu's pack hook hands back: a copy

    with torch.autograd.graph.saved_tensors_hooks(offload, lambda t: t):
        step(x.clone().requires_grad_()).backward()
    torch.testing.assert_close(weight.main_grad, ref.grad, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    weight.main_grad.zero_()
    with torch.autograd.graph.saved_tensors_hooks(offload, lambda t: t), \
            pytest.raises(Exception, match="inside saved-tensor hooks"):
        torch.compile(step, backend="aot_eager")(x.clone().requires_grad_())
    assert not weight.main_grad.any()
