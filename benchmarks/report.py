"""Turns bench_postprocess.py's JSON into RESULTS.md (tables and the issue's goals) and a plot."""

from __future__ import annotations

import json
import sys
from typing import Optional

TRITON_LPE = "mcore-hooks triton, logprob+entropy"
TRITON_CE = "mcore-hooks triton, linear-CE (sum)"
STOCK_RL = "stock RL: logits -> fp32 log_softmax -> logprob+entropy"
STOCK_FUSED = "stock loss, cross_entropy_loss_fusion"
LIGER = "Liger fused linear CE"
CE_MAIN_GRAD = "mcore-hooks triton, linear-CE (sum), dW into main_grad"
STOCK_GRPO = "stock GRPO: logits -> fp32 log_softmax -> clipped loss"
FUSED_GRPO = "mcore-hooks fused GRPO (linear_policy_loss)"
GRPO_DECLARED = "mcore-hooks GRPO, dW into main_grad in the forward (upstream_grad)"
GRPO_DECLARED_2048 = "mcore-hooks GRPO, dW into main_grad in the forward, 2048-token chunks"
LIGER_GRPO = "Liger fused linear GRPO"
STOCK_GRPO_ENT = "stock GRPO + entropy bonus"
FUSED_GRPO_ENT = "mcore-hooks fused GRPO + entropy bonus"


def _get(blob, shape, method, key, field="ms") -> Optional[float]:
    for r in blob["results"]:
        if r["shape"] == list(shape) and r["method"] == method:
            return r.get(key, {}).get(field)
    return None


def goals(blob) -> list[tuple[str, str, str, bool]]:
    """(goal, measured, target, met) for the first shape."""
    n, h, v = blob["results"][0]["shape"]
    shape = (n, h, v)
    ceiling = blob["meta"]["bf16_matmul_TFs"]
    out = []

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def add(name, value, target, ok, fmt="{:.3f}"):
        out.append((name, "n/a" if value is None else fmt.format(value), target,
                    bool(value is not None and ok(value))))

    t_f = _get(blob, shape, TRITON_LPE, "fwd")
    t_fb = _get(blob, shape, TRITON_LPE, "fwd+bwd")
    add("forward time / stock RL forward", ratio(t_f, _get(blob, shape, STOCK_RL, "fwd")), "<= 0.58", lambda r: r <= 0.58)
    add("forward fraction of bf16 matmul ceiling (2NHV)", None if t_f is None else 2 * n * h * v / t_f / 1e9 / ceiling, ">= 0.80", lambda r: r >= 0.8)
    add("forward peak extra memory (MiB)", _get(blob, shape, TRITON_LPE, "fwd", "peak_extra_mib"), "<= 64", lambda r: r <= 64, "{:.0f}")
    add("fwd+bwd time / stock RL fwd+bwd", ratio(t_fb, _get(blob, shape, STOCK_RL, "fwd+bwd")), "<= 0.75", lambda r: r <= 0.75)
    add("fwd+bwd fraction of ceiling (8NHV)", None if t_fb is None else 8 * n * h * v / t_fb / 1e9 / ceiling, ">= 0.80", lambda r: r >= 0.8)
    grads_mib = (n * h + v * h) * 2 / 2**20
    add(f"fwd+bwd peak extra memory (MiB; gradients = {grads_mib:.0f})", _get(blob, shape, TRITON_LPE, "fwd+bwd", "peak_extra_mib"),
        f"<= {grads_mib + 256:.0f}", lambda r: r <= grads_mib + 256, "{:.0f}")
    ce = _get(blob, shape, TRITON_CE, "fwd+bwd")
    add("linear-CE fwd+bwd / stock with CE fusion", ratio(ce, _get(blob, shape, STOCK_FUSED, "fwd+bwd")), "<= 0.85", lambda r: r <= 0.85)
    add("linear-CE fwd+bwd / Liger FLCE", ratio(ce, _get(blob, shape, LIGER, "fwd+bwd")), "<= 0.70", lambda r: r <= 0.7)
    if blob.get("tp2"):
        add("TP=2 per-rank fwd / TP=1 fwd", ratio(blob["tp2"]["fwd"], t_f), "<= 0.55", lambda r: r <= 0.55)
        add("TP=2 per-rank fwd+bwd / TP=1 fwd+bwd", ratio(blob["tp2"]["fwd+bwd"], t_fb), "<= 0.55", lambda r: r <= 0.55)
    # the fused policy loss and the kernels' efficiency (the policy-loss issue's goals)
    g = _get(blob, shape, FUSED_GRPO, "fwd+bwd")
    add("GRPO fwd+bwd / stock GRPO", ratio(g, _get(blob, shape, STOCK_GRPO, "fwd+bwd")), "<= 0.90", lambda r: r <= 0.9)
    add("GRPO fwd+bwd peak extra memory (MiB)", _get(blob, shape, FUSED_GRPO, "fwd+bwd", "peak_extra_mib"), "<= 2048", lambda r: r <= 2048, "{:.0f}")
    for method, tag in ((GRPO_DECLARED, ""), (GRPO_DECLARED_2048, ", 2048-token chunks")):
        gd = _get(blob, shape, method, "fwd+bwd")
        add(f"GRPO, dW into main_grad in the forward{tag}: fwd+bwd / stock GRPO",
            ratio(gd, _get(blob, shape, STOCK_GRPO, "fwd+bwd")), "<= 0.90", lambda r: r <= 0.9)
        add(f"GRPO, dW into main_grad in the forward{tag}: peak extra memory (MiB)",
            _get(blob, shape, method, "fwd+bwd", "peak_extra_mib"), "<= 2048", lambda r: r <= 2048, "{:.0f}")
    add("GRPO + entropy bonus fwd+bwd / stock", ratio(_get(blob, shape, FUSED_GRPO_ENT, "fwd+bwd"), _get(blob, shape, STOCK_GRPO_ENT, "fwd+bwd")), "<= 0.62", lambda r: r <= 0.62)
    add("Liger GRPO fwd+bwd / fused GRPO", ratio(_get(blob, shape, LIGER_GRPO, "fwd+bwd"), g), ">= 8", lambda r: r >= 8, "{:.1f}")
    shapes = []
    for r in blob["results"]:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    for sh in shapes[:2]:
        tag = "x".join(map(str, sh))
        add(f"linear-CE fwd+bwd / Liger FLCE at {tag}", ratio(_get(blob, sh, TRITON_CE, "fwd+bwd"), _get(blob, sh, LIGER, "fwd+bwd")), "<= 0.95", lambda r: r <= 0.95)
        liger_mib = _get(blob, sh, LIGER, "fwd+bwd", "peak_extra_mib")
        dx_mib = sh[0] * sh[1] * 2 / 2**20
        add(f"linear-CE into main_grad: peak extra MiB at {tag} (dX = {dx_mib:.0f})",
            _get(blob, sh, CE_MAIN_GRAD, "fwd+bwd", "peak_extra_mib"), f"<= {dx_mib + 256:.0f}",
            lambda r, d=dx_mib: r <= d + 256, "{:.0f}")
        add(f"linear-CE fwd+bwd peak extra MiB at {tag} (Liger: {liger_mib})", _get(blob, sh, TRITON_CE, "fwd+bwd", "peak_extra_mib"), "<= Liger's", lambda r, l=liger_mib: l is not None and r <= l, "{:.0f}")
    add("logprob+entropy forward fraction of ceiling (2NHV)", None if t_f is None else 2 * n * h * v / t_f / 1e9 / ceiling, ">= 0.88", lambda r: r >= 0.88)
    add("two-pass fwd+bwd fraction of ceiling (8NHV)", None if t_fb is None else 8 * n * h * v / t_fb / 1e9 / ceiling, ">= 0.85", lambda r: r >= 0.85)
    ordinary = [r for r in blob.get("accuracy", []) if r["case"] == "ordinary"]
    hard = [r for r in blob.get("accuracy", []) if r["case"] != "ordinary"]
    for label, rows, target in (("ordinary", ordinary, 2e-6), ("hard", hard, 1e-4)):
        if rows:
            keys = [f"mcore-hooks {m} {k}" for m in ("triton", "fused policy") for k in ("logprob", "entropy")]
            worst = max(r[k] for r in rows for k in keys if isinstance(r.get(k), float))
            add(f"accuracy vs float64, {label} logits (max rel)", worst, f"<= {target:g}", lambda r, t=target: r <= t, "{:.2e}")
    return out


def write_results_md(blob, path: str) -> None:
    m = blob["meta"]
    lines = [
        "# Post-process benchmark results",
        "",
        f"- date: {m['date']}",
        f"- device: {m['device']}; bf16 matmul ceiling measured in the same run: {m['bf16_matmul_TFs']} TF/s",
        f"- torch {m['torch']}, Triton {m['triton']}, Megatron Core {m['megatron_core']}, Liger-Kernel {m['liger_kernel']}",
        f"- command: `{m['command']}`",
        "",
        "Median time (ms) and peak memory allocated beyond the inputs (MiB); forward without grad,",
        "forward+backward with gradients to hidden states and output weight. bf16 inputs.",
        "",
    ]
    shapes = []
    for r in blob["results"]:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    for shape in shapes:
        lines += [f"## {shape[0]} tokens x hidden {shape[1]} x vocab {shape[2]}", "",
                  "| method | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd MiB |", "|---|---|---|---|---|"]
        for r in blob["results"]:
            if r["shape"] != shape:
                continue
            cells = []
            for key in ("fwd", "fwd+bwd"):
                d = r.get(key, {})
                if "ms" in d:
                    cells += [f"{d['ms']:.1f}", f"{d['peak_extra_mib']:.0f}"]
                else:
                    cells += [d.get("error", r.get("error", "-")), ""]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        lines.append("")
    if blob.get("tp2"):
        t = blob["tp2"]
        lines += ["## TP=2 (two GPUs, vocab split, per-rank time of the slower rank)", "",
                  f"mcore-hooks triton logprob+entropy, shape {t['shape']}: fwd {t['fwd']:.1f} ms, "
                  f"fwd+bwd {t['fwd+bwd']:.1f} ms", ""]
    if blob.get("accuracy"):
        keys = [k for k in blob["accuracy"][0] if k not in ("vocab", "case")]
        lines += ["## Accuracy against float64 (bf16 inputs, 2048 tokens, norm-wise relative error)", "",
                  "| vocab | logits | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r in blob["accuracy"]:
            cells = [f"{r[k]:.1e}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            lines.append(f"| {r['vocab']} | {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Goals (first shape, ratios from this run)", "", "| goal | measured | target | met |",
              "|---|---|---|---|"]
    for name, value, target, ok in goals(blob):
        lines.append(f"| {name} | {value} | {target} | {'yes' if ok else 'no'} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(blob, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shape = blob["results"][0]["shape"]
    rows = [r for r in blob["results"] if r["shape"] == shape]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(15, 11))
    for col, key in enumerate(("fwd", "fwd+bwd")):
        for row, (field, label) in enumerate((("ms", "median time (ms)"), ("peak_extra_mib", "peak extra memory (MiB)"))):
            ax = axes[row][col]
            vals = [r.get(key, {}).get(field, 0) or 0 for r in rows]
            colors = ["#2a7" if n.startswith("mcore-hooks") else "#c63" if n.startswith("Liger") else "#888"
                      for n in names]
            ax.barh(range(len(names)), vals, color=colors)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names if col == 0 else [""] * len(names), fontsize=8)
            ax.set_xlabel(label)
            ax.set_title(f"{key}, {shape[0]}x{shape[1]}x{shape[2]} bf16")
            if field == "peak_extra_mib":
                ax.set_xscale("symlog")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    blob = json.load(open(sys.argv[1]))
    write_results_md(blob, sys.argv[2] if len(sys.argv) > 2 else "RESULTS.md")
