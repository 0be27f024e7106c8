"""The equivalence check: every bundled processor, through the hook, against the stock model;
the integrations' (verl's, NeMo RL's) on GPTModel, the model those frameworks run.

Two kinds of check, for each supported model class of the installed Megatron Core, each parallel
layout and tied / untied output weights:

* **float32 models**, against the stock model: two tiny models with identical weights, the stock
  class and the hooked class. The stock forward and the hooked forward with the check's processor
  are compared, and after the same weighted-sum backward so is every parameter's gradient:
  bitwise where the processor computes what stock computes, within float32 rounding where it
  sums in another order.
* **bf16 models**, against float64: the processor runs through the hook (the default backend:
  Triton on a CUDA GPU that has tiles for it), and so does the stock post-process (output layer,
  bf16 logits, Megatron's loss or an fp32 ``log_softmax``) on the same hidden states; both are
  compared with a float64 computation from those hidden states and the output weight. The rule:
  values at least as accurate as stock (float32 outputs); gradients of the hidden states and the
  output weight at least as accurate as stock up to one bf16 rounding of the result (below).

Run by ``mcore-hooks verify``; usable from tests as :func:`run_checks`. The checks themselves
(each processor, what stock computes for it, its float64 reference) are in
:mod:`mcore_hooks.verify_checks`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import compat
from .hooked import hooked_class
from .postprocess import PostprocessContext
from .testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    cpu_shims,
    stock_model_class,
    tiny_batch,
)
from .verify_checks import (  # noqa: F401  (re-exported: the checks' definitions)
    PRECISION_CHECKS, PROCESSOR_CHECKS, PrecisionCheck, ProcessorCheck, _HOOK_OFF,
)

__all__ = [
    "CheckResult", "ProcessorCheck", "PrecisionCheck", "PROCESSOR_CHECKS", "PRECISION_CHECKS",
    "run_checks", "format_table", "processor_names",
]

@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One row of the table. ``value_rel`` / ``grad_rel`` are the processor's norm-wise relative
    errors (against stock, or float64 for ``rule == "vs float64"``, where ``stock_value_rel`` /
    ``stock_grad_rel`` are stock's own errors against float64)."""

    model: str
    layout: str
    processor: str
    value_abs: float
    value_rel: float
    grad_abs: float
    grad_rel: float
    tolerance: float
    passed: bool
    error: str = ""
    rule: str = "vs stock"
    stock_value_rel: float = math.nan
    stock_grad_rel: float = math.nan


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max absolute error, and the norm-wise relative error ||got - ref|| / ||ref||."""
    if got.shape != ref.shape:
        return math.inf, math.inf
    if not got.numel():
        return 0.0, 0.0
    diff = got.double() - ref.double()
    scale = ref.double().norm().item()
    err = diff.norm().item()
    return diff.abs().max().item(), err / scale if scale > 0 else err


def _weighting(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    # A fixed random weighting makes every output element matter to the gradients.
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g, dtype=torch.float32).to(device)


def _as_tensor(out: Any) -> torch.Tensor:
    return torch.stack([o.float() for o in out]) if isinstance(out, (tuple, list)) else out


def _run(model: torch.nn.Module, forward: Callable[[], Any], seed: int):
    """Forward, then backward of a fixed random weighting; returns output and every gradient."""
    model.zero_grad(set_to_none=True)
    out = _as_tensor(forward())
    (out.float() * _weighting(out.shape, seed, out.device)).sum().backward()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    return out.detach(), grads


def _all_gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    if compat.group_rank_size(group)[1] == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(compat.group_rank_size(group)[1])]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _Capture:
    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner, self.kwargs = inner, None

    def __call__(self, **kwargs: Any) -> Any:
        self.kwargs = kwargs
        return self.inner(**kwargs)


def _precision_errors(check: PrecisionCheck, model: torch.nn.Module, batch: dict, seed: int):
    """The processor (through the hook) and stock against float64, values and the gradients of
    the hidden states and the output weight: ((ours value, stock value), (ours grad, stock grad))
    as norm-wise relative errors, plus the processor's max absolute value error."""
    cap = _Capture(check.make())
    extra = {} if check.context is None else {"output_processor_context": check.context(batch)}
    through_hook = _as_tensor(model(**batch, output_processor=cap, **extra)).detach()
    # Gradients of the hook's inputs: the same call on the same keywords, with the hidden states
    # and the output weight as leaves (a tied weight's path through the embedding is left out).
    leaves = PostprocessContext.from_kwargs(cap.kwargs)
    hidden = leaves.hidden_states.detach().requires_grad_()
    weight = leaves.weight.detach().requires_grad_()
    kwargs = dict(cap.kwargs, hidden_states=hidden, output_weight=weight)
    ctx = PostprocessContext.from_kwargs(kwargs)
    ours = _as_tensor(check.make()(**kwargs))
    if not torch.equal(ours.detach(), through_hook):
        raise AssertionError(f"{check.name}: called directly, it differs from its result through the hook")
    wt = _weighting(ours.shape, seed, ours.device)
    ours_grads = torch.autograd.grad((ours.float() * wt).sum(), [hidden, weight])
    stock = check.stock(ctx)
    stock_grads = torch.autograd.grad((stock.float() * wt).sum(), [hidden, weight])

    # float64 from the same bf16 hidden states and weight, over the whole vocabulary
    rank = ctx.tp_rank
    h = _all_gather(hidden.detach(), ctx.tp_group, 0) if ctx.sequence_parallel else hidden.detach()
    h64 = h.double().requires_grad_()
    w64 = _all_gather(weight.detach(), ctx.tp_group, 0).double().requires_grad_()
    logp = torch.log_softmax((h64 @ w64.t()) * ctx.logit_scale(), dim=-1)
    exact = check.exact(logp, ctx)
    dh, dw = torch.autograd.grad((exact * wt.double()).sum(), [h64, w64])
    if ctx.sequence_parallel:
        dh = dh.chunk(ctx.tp_size)[rank]
    dw = dw.chunk(ctx.tp_size)[rank]

    def grad_rel(grads: Sequence[torch.Tensor]) -> float:
        return max(_errors(grads[0], dh)[1], _errors(grads[1], dw)[1])

    value = (_errors(ours, exact)[1], _errors(stock, exact)[1])
    grad = (grad_rel(ours_grads), grad_rel(stock_grads))
    return value, grad, _errors(ours, exact)[0], max(_errors(g, r)[0] for g, r in zip(ours_grads, (dh, dw)))


# Gradients are bf16 in both paths, each the bf16 rounding of a float32 result: rounding moves an
# element by up to half a bf16 ulp (2**-9 relative), towards the float64 value or away from it, so
# of two results equally accurate before rounding, one can be farther after it by up to
# 2**-9 * (|ours| + |stock|) ~ 2**-8 relative, norm-wise. The rule: ours <= stock + 2**-8 (at least
# as accurate before the final rounding); the table says which of the two holds.
_BF16_ROUNDING = 2.0**-8


def _layouts(model_class: str, tp: int) -> Iterable[tuple[bool, bool, bool]]:
    """(tied, sequence_parallel, packed) combinations to check for one class and TP size."""
    packed = compat.forward_accepts(stock_model_class(model_class), "packed_seq_params")
    for tied in (True, False):
        for sp in (False, True) if tp > 1 else (False,):
            yield tied, sp, False
            if packed:
                yield tied, sp, True


def _layout_name(tp: int, sp: bool, packed: bool, tied: bool, dtype: str = "") -> str:
    parts = [f"tp{tp}", dtype, "sp" if sp else "", "packed" if packed else "", "tied" if tied else "untied"]
    return " ".join(p for p in parts if p)


def run_checks(
    checks: Sequence[ProcessorCheck] = PROCESSOR_CHECKS,
    *,
    device: str = "cpu",
    model_classes: Optional[Sequence[str]] = None,
    precision_checks: Sequence[PrecisionCheck] = PRECISION_CHECKS,
    progress: Optional[Callable[[str], None]] = None,
) -> list[CheckResult]:
    """Run every check for every class and layout on this rank (model parallel already set up):
    ``checks`` on float32 models against stock, ``precision_checks`` on bf16 models against
    float64.

    The tiny CPU models run inside a :func:`~mcore_hooks.testing.cpu_shims` scope: on return
    Megatron Core is exactly as it was found. On the CPU they run on one thread (their matrices
    are too small to share out; on a busy machine, or with several ranks, more threads wait on
    each other): torch's thread count is put back on return.

    ``progress``: called with one line after each class's float32 group and bf16 group (the
    rows, how many passed, the seconds taken).
    """
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        with cpu_shims():
            results: list[CheckResult] = []
            for model_class in model_classes or available_model_classes():
                for what, run, group in (("float32 vs stock", _stock_checks, checks),
                                         ("bf16 vs float64", _precision_checks, precision_checks)):
                    start = time.perf_counter()
                    rows = run(group, device, model_class)
                    results += rows
                    if progress is not None and rows:
                        progress(_progress_line(model_class, what, rows, time.perf_counter() - start))
            return results
    finally:
        torch.set_num_threads(threads)


def processor_names(names: Iterable[str]) -> list[str]:
    """The processors of checks or rows named ``names``, by class name, in order and once each
    (``"LinearCEProcessor, sum"`` is ``LinearCEProcessor``; the hook-off row, stock itself, is
    no processor)."""
    return [n for n in dict.fromkeys(name.split(",")[0] for name in names) if n != _HOOK_OFF]


def _progress_line(model_class: str, what: str, rows: Sequence[CheckResult], seconds: float) -> str:
    names = processor_names(r.processor for r in rows)
    layouts = len({r.layout for r in rows})
    passed = sum(r.passed for r in rows)
    return (f"{model_class} {rows[0].layout.split()[0]} {what}: {len(rows)} checks ({len(names)} "
            f"processors, {layouts} layouts), {passed} passed, {len(rows) - passed} failed, {seconds:.1f} s")


def _stock_checks(checks, device, model_class) -> list[CheckResult]:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    results: list[CheckResult] = []
    for tied, sp, packed in _layouts(model_class, tp):
        cfg = TinyModelConfig(model_class=model_class, tied=tied, sequence_parallel=sp)
        layout = _layout_name(tp, sp, packed, tied)
        stock = build_tiny_model(cfg).to(device)
        hooked = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(model_class))).to(device)
        hooked.load_state_dict(stock.state_dict())
        # A process's first forward+backward on the CPU can take another code path in the math
        # libraries (seen in 1 process of 30: that first result differed in the last bits from
        # every later one, stock's and the hooked model's alike). One run first keeps the
        # bitwise checks about the hook.
        warm = tiny_batch(cfg, packed=packed, with_labels=True)
        _run(stock, lambda: stock(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in warm.items()}),
             seed=0)
        for i, check in enumerate(checks):
            if check.models is not None and model_class not in check.models:
                continue
            batch = tiny_batch(cfg, packed=packed, with_labels=check.with_labels, seed=i)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if check.inputs is not None:
                batch = check.inputs(batch)
            processor = check.make()
            extra = {} if check.context is None else {"output_processor_context": check.context(batch)}
            ref, ref_grads = _run(stock, lambda: check.reference(stock, batch), seed=i)
            got, got_grads = _run(
                hooked, lambda: hooked(**batch, output_processor=processor, **extra), seed=i
            )
            v_abs, v_rel = _errors(got, ref)
            g_abs = g_rel = 0.0
            for name, rg in ref_grads.items():
                a, r = _errors(got_grads[name], rg)
                g_abs, g_rel = max(g_abs, a), max(g_rel, r)
            ok = max(v_rel, g_rel) <= check.tolerance if check.tolerance else (
                v_abs == 0.0 and g_abs == 0.0
            )
            results.append(
                CheckResult(model_class, layout, check.name, v_abs, v_rel, g_abs, g_rel,
                            check.tolerance, ok)
            )
    return results


def _precision_checks(checks, device, model_class) -> list[CheckResult]:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    results: list[CheckResult] = []
    if not checks:
        return results
    for tied, sp, packed in _layouts(model_class, tp):
        cfg = TinyModelConfig(
            model_class=model_class, tied=tied, sequence_parallel=sp, params_dtype=torch.bfloat16
        )
        model = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(model_class))).to(device)
        layout = _layout_name(tp, sp, packed, tied, "bf16")
        for i, check in enumerate(checks):
            if check.models is not None and model_class not in check.models:
                continue
            batch = tiny_batch(cfg, packed=packed, seed=100 + i)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if check.inputs is not None:
                batch = check.inputs(batch)
            (v_ours, v_stock), (g_ours, g_stock), v_abs, g_abs = _precision_errors(
                check, model, batch, seed=i
            )
            ok = v_ours <= v_stock and g_ours <= g_stock + _BF16_ROUNDING
            results.append(
                CheckResult(model_class, layout, check.name, v_abs, v_ours, g_abs, g_ours,
                            _BF16_ROUNDING, ok, rule="vs float64", stock_value_rel=v_stock,
                            stock_grad_rel=g_stock)
            )
    return results


def merge_ranks(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """One row per check: the worst error over ranks (each rank compares its own shards)."""
    merged = []
    for rows in zip(*per_rank):
        worst = max(rows, key=lambda r: (not r.passed, r.value_rel, r.grad_rel))
        merged.append(
            dataclasses.replace(
                worst,
                value_abs=max(r.value_abs for r in rows),
                value_rel=max(r.value_rel for r in rows),
                grad_abs=max(r.grad_abs for r in rows),
                grad_rel=max(r.grad_rel for r in rows),
                stock_value_rel=max(r.stock_value_rel for r in rows),
                stock_grad_rel=max(r.stock_grad_rel for r in rows),
                passed=all(r.passed for r in rows),
            )
        )
    return merged


def _verdict(r: CheckResult) -> str:
    if not r.passed:
        return "FAIL" + (f" {r.error}" if r.error else "")
    if r.rule == "vs float64":
        if r.value_rel <= r.stock_value_rel and r.grad_rel <= r.stock_grad_rel:
            return "pass (at least as accurate as stock)"
        return "pass (gradients within one bf16 rounding of stock's accuracy)"
    return "pass (bitwise)" if not r.tolerance else f"pass (<= {r.tolerance:.0e})"


def format_table(results: Sequence[CheckResult]) -> str:
    """The results as a text table: errors relative to stock (float32 models), or to float64
    beside stock's own (bf16 models, ``ours / stock``)."""
    head = ("model", "layout", "processor", "reference", "value rel", "grad rel", "result")

    def pair(ours: float, stock: float, rule: str) -> str:
        return f"{ours:.1e} / {stock:.1e}" if rule == "vs float64" else f"{ours:.2e}"

    rows = [
        (r.model, r.layout, r.processor,
         "float64 (ours / stock)" if r.rule == "vs float64" else "stock",
         pair(r.value_rel, r.stock_value_rel, r.rule), pair(r.grad_rel, r.stock_grad_rel, r.rule),
         _verdict(r))
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    legend = [
        "",
        "value rel / grad rel: norm-wise relative errors (grad: the worst parameter's, or of the hidden",
        "states and output weight). reference stock: float32 models, the processor through the hook",
        "against the stock path, bitwise or within the tolerance shown. reference float64: bf16 models,",
        "ours / stock against float64; values must be at least as accurate as stock, gradients at least",
        "as accurate up to one bf16 rounding of the result (2**-8).",
    ]
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows] + legend)


def to_json(results: Sequence[CheckResult], **meta: Any) -> str:
    def clean(x: Any) -> Any:
        return None if isinstance(x, float) and not math.isfinite(x) else x

    rows = [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in results]
    return json.dumps({**meta, "passed": all(r.passed for r in results), "results": rows}, indent=2)
