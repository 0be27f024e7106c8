"""The equivalence check: every bundled processor, through the hook, against the stock model.

For each supported model class of the installed Megatron Core, each parallel layout and tied /
untied output weights, two tiny models with identical weights are built: the stock class and the
hooked class. Each check runs the stock forward and the hooked forward with the check's processor,
compares the outputs and, after the same weighted-sum backward, every parameter's gradient. Run by
``mcore-hooks verify``; usable from tests as :func:`run_checks`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import compat
from .postprocess import DefaultProcessor, hooked_class
from .processors import (
    EntropyProcessor,
    FusedLogprobProcessor,
    LinearCEProcessor,
    LogprobEntropyProcessor,
)
from .testing import (
    TinyModelConfig,
    available_model_classes,
    build_tiny_model,
    cpu_shims,
    stock_model_class,
    tiny_batch,
)

__all__ = ["CheckResult", "ProcessorCheck", "PROCESSOR_CHECKS", "run_checks", "format_table"]


@dataclasses.dataclass(frozen=True)
class ProcessorCheck:
    """One processor to verify: how to make it, what stock computes for it, how close it must be.

    ``tolerance`` is the largest allowed relative error of values and gradients; 0 means bitwise.
    """

    name: str
    make: Callable[[], Optional[Callable[..., Any]]]
    reference: Callable[[torch.nn.Module, dict], torch.Tensor]
    with_labels: bool
    tolerance: float = 0.0


def _stock(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)


def _stock_logprob(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return -model(**batch)  # the stock per-token loss is -log p(label)


def _stock_entropy(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Entropy from the stock, gathered logits with a float64 log-softmax."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kwargs, runtime_gather_output=True)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1).float()


def _stock_logprob_entropy(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.stack([_stock_logprob(model, batch), _stock_entropy(model, batch)])


def _stock_masked_sum(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    loss = model(**batch)
    mask = batch.get("loss_mask")
    return (loss * mask).sum() if mask is not None else loss.sum()


def _stock_masked_mean(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    loss = model(**batch)
    mask = batch.get("loss_mask")
    if mask is None:
        return loss.mean()
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


# fp32 tolerance for the fused processors: they sum in a different order than stock.
_FP32 = 1e-5

PROCESSOR_CHECKS: tuple[ProcessorCheck, ...] = (
    ProcessorCheck("hook off (None), loss", lambda: None, _stock, with_labels=True),
    ProcessorCheck("DefaultProcessor, loss", DefaultProcessor, _stock, with_labels=True),
    ProcessorCheck("DefaultProcessor, logits", DefaultProcessor, _stock, with_labels=False),
    ProcessorCheck("FusedLogprobProcessor", FusedLogprobProcessor, _stock_logprob, True, _FP32),
    ProcessorCheck("EntropyProcessor", EntropyProcessor, _stock_entropy, False, _FP32),
    ProcessorCheck(
        "LogprobEntropyProcessor", lambda: LogprobEntropyProcessor(as_tuple=True),
        _stock_logprob_entropy, True, _FP32,
    ),
    ProcessorCheck("LinearCEProcessor", LinearCEProcessor, _stock, True, _FP32),
    ProcessorCheck(
        "LinearCEProcessor, sum", lambda: LinearCEProcessor(reduction="sum"),
        _stock_masked_sum, True, _FP32,
    ),
    ProcessorCheck(
        "LinearCEProcessor, mean", lambda: LinearCEProcessor(reduction="mean"),
        _stock_masked_mean, True, _FP32,
    ),
)


@dataclasses.dataclass(frozen=True)
class CheckResult:
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


def _run(model: torch.nn.Module, forward: Callable[[], Any], seed: int):
    """Forward, then backward of a fixed random weighting; returns output and every gradient."""
    model.zero_grad(set_to_none=True)
    out = forward()
    if isinstance(out, (tuple, list)):
        out = torch.stack([o.float() for o in out])
    # A fixed random weighting makes every output element matter to the gradients.
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(out.shape, generator=g, dtype=torch.float32).to(out.device)
    (out.float() * w).sum().backward()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    return out.detach(), grads


def _layouts(model_class: str, tp: int) -> Iterable[tuple[bool, bool, bool]]:
    """(tied, sequence_parallel, packed) combinations to check for one class and TP size."""
    packed = compat.forward_accepts(stock_model_class(model_class), "packed_seq_params")
    for tied in (True, False):
        for sp in (False, True) if tp > 1 else (False,):
            yield tied, sp, False
            if packed:
                yield tied, sp, True


def run_checks(
    checks: Sequence[ProcessorCheck] = PROCESSOR_CHECKS,
    *,
    device: str = "cpu",
    model_classes: Optional[Sequence[str]] = None,
) -> list[CheckResult]:
    """Run every check for every class and layout on this rank (model parallel already set up).

    The tiny CPU models run inside a :func:`~mcore_hooks.testing.cpu_shims` scope: on return
    Megatron Core is exactly as it was found.
    """
    with cpu_shims():
        return _run_checks(checks, device, model_classes)


def _run_checks(checks, device, model_classes) -> list[CheckResult]:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    results: list[CheckResult] = []
    for model_class in model_classes or available_model_classes():
        for tied, sp, packed in _layouts(model_class, tp):
            cfg = TinyModelConfig(model_class=model_class, tied=tied, sequence_parallel=sp)
            layout = f"tp{tp}{' sp' if sp else ''}{' packed' if packed else ''} {'tied' if tied else 'untied'}"
            stock = build_tiny_model(cfg).to(device)
            hooked = build_tiny_model(cfg, model_cls=hooked_class(stock_model_class(model_class))).to(device)
            hooked.load_state_dict(stock.state_dict())
            for i, check in enumerate(checks):
                batch = tiny_batch(cfg, packed=packed, with_labels=check.with_labels, seed=i)
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                try:
                    processor = check.make()
                    ref, ref_grads = _run(stock, lambda: check.reference(stock, batch), seed=i)
                    got, got_grads = _run(
                        hooked, lambda: hooked(**batch, output_processor=processor), seed=i
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
                except Exception as e:  # report, don't stop: the table shows every failure
                    results.append(
                        CheckResult(model_class, layout, check.name, math.inf, math.inf, math.inf,
                                    math.inf, check.tolerance, False, f"{type(e).__name__}: {e}")
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
                passed=all(r.passed for r in rows),
            )
        )
    return merged


def format_table(results: Sequence[CheckResult]) -> str:
    head = ("model", "layout", "processor", "value abs", "value rel", "grad abs", "grad rel", "result")
    rows = [
        (
            r.model,
            r.layout,
            r.processor,
            f"{r.value_abs:.2e}",
            f"{r.value_rel:.2e}",
            f"{r.grad_abs:.2e}",
            f"{r.grad_rel:.2e}",
            ("pass" if r.passed else "FAIL") + (" (bitwise)" if r.passed and not r.tolerance else "")
            + (f" {r.error}" if r.error else ""),
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def to_json(results: Sequence[CheckResult], **meta: Any) -> str:
    def clean(x: Any) -> Any:
        return None if isinstance(x, float) and not math.isfinite(x) else x

    rows = [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in results]
    return json.dumps({**meta, "passed": all(r.passed for r in results), "results": rows}, indent=2)
