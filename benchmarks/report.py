"""Generates ``benchmarks/RESULTS.md`` from the result files in ``benchmarks/results/``.

    python benchmarks/report.py           # rewrite RESULTS.md
    python benchmarks/report.py --check   # exit 1 if RESULTS.md is not what it would write

One file per benchmark and GPU (``results/<bench>_<gpu>.json`` or ``.log``), replaced when the
benchmark is re-run (history is git's). A JSON file holds ``{"benchmark", "gpu", "runs": [{"meta":
{"date", "commit", "gpu", "command", ...}, ...}]}``; a log holds runs, each after a line
``### run: {meta as JSON}``. Only numbers in those files reach RESULTS.md. The benchmark programs
write there by default (:func:`default_path`), and import the renderers here (no torch needed).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import statistics
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")

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


def postprocess_lines(blob) -> list[str]:
    """bench_postprocess.py's run: a table per shape, TP=2, accuracy and the goals."""
    m = blob["meta"]
    lines = [
        f"- bf16 matmul ceiling measured in the same run: {m['bf16_matmul_TFs']} TF/s; torch {m['torch']}, "
        f"Triton {m['triton']}, Megatron Core {m['megatron_core']}, Liger-Kernel {m['liger_kernel']}",
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
        lines += [f"### {shape[0]} tokens x hidden {shape[1]} x vocab {shape[2]}", "",
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
        lines += ["### TP=2 (two GPUs, vocab split, per-rank time of the slower rank)", "",
                  f"mcore-hooks triton logprob+entropy, shape {t['shape']}: fwd {t['fwd']:.1f} ms, "
                  f"fwd+bwd {t['fwd+bwd']:.1f} ms", ""]
    if blob.get("accuracy"):
        keys = [k for k in blob["accuracy"][0] if k not in ("vocab", "case")]
        lines += ["### Accuracy against float64 (bf16 inputs, 2048 tokens, norm-wise relative error)", "",
                  "| vocab | logits | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r in blob["accuracy"]:
            cells = [f"{r[k]:.1e}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            lines.append(f"| {r['vocab']} | {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Goals (first shape, ratios from this run)", "", "| goal | measured | target | met |",
              "|---|---|---|---|"]
    for name, value, target, ok in goals(blob):
        lines.append(f"| {name} | {value} | {target} | {'yes' if ok else 'no'} |")
    return lines + [""]


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


# --------------------------------------------------------------------------- where results go


def gpu_tag(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``: a result file's suffix."""
    for word in name.replace("NVIDIA", "").split():
        if any(c.isdigit() for c in word):
            return word.lower()
    return "_".join(name.lower().split()) or "cpu"


def default_path(bench: str, ext: str = "json", gpu: Optional[str] = None) -> str:
    """``benchmarks/results/<bench>_<gpu>.<ext>``, the GPU's from torch where not given."""
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return os.path.join(RESULTS_DIR, f"{bench}_{gpu_tag(gpu)}.{ext}")


def run_meta(**extra) -> dict:
    """A run's metadata: date, commit (``git describe``, ``-dirty`` where the tree has changes),
    GPU, software and command."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=HERE,
                                capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    meta = {"date": str(datetime.date.today()), "commit": commit, "command": " ".join(["python"] + sys.argv)}
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    meta.update(extra)
    return meta


def write_result(path: str, bench: str, runs: list[dict], key: Optional[str] = None) -> None:
    """Replace ``path`` with these runs (a run: ``{"meta": ..., <its data>}``); with ``key``, the
    file's runs whose ``meta[key]`` differs from every new run's are kept (a benchmark run one case
    at a time, as ``bench_step.py`` a shape or ``bench_verl.py`` a case)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if key is not None and os.path.exists(path):
        new = [json.dumps(r["meta"].get(key), sort_keys=True) for r in runs]
        try:
            old = json.load(open(path)).get("runs", [])
        except (json.JSONDecodeError, AttributeError):
            old = []
        runs = runs + [r for r in old if json.dumps(r.get("meta", {}).get(key), sort_keys=True) not in new]
    with open(path, "w") as f:
        json.dump({"benchmark": f"benchmarks/{bench}", "gpu": runs[0]["meta"].get("gpu", ""), "runs": runs}, f, indent=1)
        f.write("\n")


def load_rows(path: str) -> list[dict]:
    """A sweep's rows: a result file's runs, a ``--json`` list, or the JSON lines a run prints."""
    with open(path) as f:
        text = f.read()
    try:
        blob = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if isinstance(blob, dict) and "runs" in blob:
        return [r for run in blob["runs"] for r in run["rows"]]
    return blob if isinstance(blob, list) else [blob]


# --------------------------------------------------------------------------- the sweep's summary

STOCK_OF = {"lp": "stock_lp", "ce": "stock_ce", "liger_ce": "stock_ce", "policy": "stock_policy",
            "policy_main_grad": "stock_policy_main_grad",
            "policy_main_grad_declared": "stock_policy_main_grad"}
# the bar: the log-prob pass within 1.1x of stock, the fused losses no slower
BAR = {"lp": 1.1, "ce": 1.0, "policy": 1.0, "policy_main_grad": 1.0, "policy_main_grad_declared": 1.0}


def ratio(r: dict, stock: dict) -> float:
    """A path's wall over its stock path's: the median of the rounds' ratios where both were
    timed in the same rounds, else of the walls."""
    a, b = r.get("wall_rounds"), stock.get("wall_rounds")
    if a and b and len(a) == len(b) and len(a) > 1:
        return statistics.median(x / y for x, y in zip(a, b))
    return r["wall"] / stock["wall"]


def summary(rows: list[dict]) -> str:
    """Markdown: per vocabulary, a row per (tokens, hidden): each entry point's wall time over
    its stock path's (* past the bar), then the entry points' launches (fewest-most) and most
    host ms, and the stock paths' most host ms (the back-to-back ``host_b2b`` where the run has
    it, else the single call's ``host``; Megatron's cross-entropy left out of stock's, as it
    waits on the device at large calls). Paths no row has are left out."""
    by = {(r["tokens"], r["hidden"], r["vocab"], r["path"]): r for r in rows if r["section"] == "entry"}
    paths = [p for p in ["lp", "ce", "policy", "policy_main_grad", "policy_main_grad_declared", "liger_ce"]
             if any(k[3] == p for k in by)]
    out = []
    for v in sorted({k[2] for k in by}, reverse=True):
        out += [f"\nVocabulary {v}: wall / stock's wall (`*`: past the bar; OOM: out of memory)\n",
                "| tokens | hidden | " + " | ".join(paths) + " | launches | host ms (most) | stock host ms (most) |",
                "|---" * (len(paths) + 5) + "|"]
        for n, h in sorted({(k[0], k[1]) for k in by if k[2] == v}):
            cells, launches, host, shost = [], [], 0.0, 0.0
            for p in paths:
                r, s_ = by.get((n, h, v, p)), by.get((n, h, v, STOCK_OF[p]))
                if r is None or r.get("oom"):
                    cells.append("" if r is None else "OOM")
                    continue
                if p != "liger_ce":
                    launches.append(r["launches"])
                    host = max(host, r.get("host_b2b", r["host"]))
                if s_ is None or s_.get("oom"):
                    cells.append(f"{r['wall']:.0f} ms, stock OOM")
                    continue
                if STOCK_OF[p] != "stock_ce":
                    shost = max(shost, s_.get("host_b2b", s_["host"]))
                x = ratio(r, s_)
                cells.append(f"{x:.2f}{'*' if x > BAR.get(p, 99) else ''}")
            lo, hi = (min(launches), max(launches)) if launches else (None, None)
            span = "" if lo is None else f"{lo}-{hi}" if lo < hi else f"{lo}"
            out.append(f"| {n} | {h} | " + " | ".join(cells) + f" | {span} | {host:.2f} | {shost:.2f} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- RESULTS.md's sections


def _meta_lines(m: dict) -> list[str]:
    out = [f"- date {m.get('date', 'not recorded')}; commit {m.get('commit', 'not recorded')}; "
           f"GPU: {m.get('gpu', m.get('device', 'not recorded'))}"]
    if m.get("software") or m.get("torch"):
        out.append(f"- software: {m.get('software') or 'torch ' + m['torch']}")
    out.append(f"- command: `{m.get('command', 'not recorded')}`")
    for key in ("note", "commit_note", "transcribed"):
        if m.get(key):
            out.append(f"- {key.replace('_', ' ')}: {m[key]}")
    return out


def _load(name: str):
    path = os.path.join(RESULTS_DIR, name)
    if not os.path.exists(path):
        return None
    if name.endswith(".log"):
        runs, cur = [], None
        for line in open(path).read().splitlines():
            if line.startswith("### run: "):
                cur = {"meta": json.loads(line[len("### run: "):]), "lines": []}
                runs.append(cur)
            elif cur is not None:
                cur["lines"].append(line)
        return {"runs": runs}
    return json.load(open(path))


def _src(name: str) -> str:
    return f"`benchmarks/results/{name}`"


def sec_e2e(name: str, blob: dict) -> list[str]:
    out = [f"## End to end: a GRPO micro-step of a Qwen2.5-1.5B-shaped GPTModel ({_src(name)})", ""]
    for run in blob["runs"]:
        m, rows = run["meta"], run["rows"]
        mem = "peak_mib" if any("peak_mib" in r for r in rows) else "peak_extra_mib"
        out += [f"### {m['date']}", ""] + _meta_lines(m) + ["",
                f"| recompute | tokens | method | ms | {mem.replace('_', ' ')} | loss |", "|---|---|---|---|---|---|"]
        for r in rows:
            cells = ["out of memory", "", ""] if r.get("oom") else [f"{r['ms']:.1f}", f"{r[mem]}", f"{r['loss']:.6f}"]
            out.append(f"| {r['recompute']} | {r['tokens']} | {r['method']} | " + " | ".join(cells) + " |")
        if len({r["recompute"] for r in rows}) > 1:
            out += ["", "The best fit, the fastest recompute that fits, per path (x: stock's ms over the path's):", "",
                    "| tokens | stock | logprob-entropy | policy-loss |", "|---|---|---|---|"]
            for n in sorted({r["tokens"] for r in rows}):
                best = {}
                for meth in ("stock", "logprob-entropy", "policy-loss"):
                    fit = [r for r in rows if r["tokens"] == n and r["method"] == meth and not r.get("oom")]
                    best[meth] = min(fit, key=lambda r: r["ms"]) if fit else None
                s = best["stock"]
                cells = []
                for meth in ("stock", "logprob-entropy", "policy-loss"):
                    b = best[meth]
                    if b is None:
                        cells.append("out of memory")
                    else:
                        x = f" ({s['ms'] / b['ms']:.2f}x)" if s is not None and meth != "stock" else ""
                        cells.append(f"{b['recompute']}, {b['ms']:.1f} ms{x}")
                out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    return out


PATHS_STEP = ["stock", "logprob", "stock_policy", "policy", "policy_main_grad"]
PAIRS_STEP = {"logprob": "stock", "policy": "stock_policy", "policy_main_grad": "stock_policy"}


def sec_step(name: str, blob: dict) -> list[str]:
    out = [f"## A training step through Megatron's schedule, DDP and optimizer ({_src(name)})", "",
           "Median step ms of each path; x stock: logprob / policy / policy_main_grad over their stock path's; "
           "peak MiB in the order of the ms columns; the largest relative difference of any parameter's gradient from stock's.", ""]
    for run in blob["runs"]:
        m = run["meta"]
        out += [f"### shape {m['shape']}, {m['date']}", ""] + _meta_lines(m) + ["",
                "| layout | " + " | ".join(f"{p} ms" for p in PATHS_STEP) + " | x stock | peak MiB | max grad rel diff |",
                "|---" * (len(PATHS_STEP) + 4) + "|"]
        for layout, rows in run["results"].items():
            ms = " | ".join(f"{rows[p]['ms']:.1f}" if p in rows else "" for p in PATHS_STEP)
            x = " / ".join(f"{rows[p]['ms'] / rows[q]['ms']:.2f}" for p, q in PAIRS_STEP.items() if p in rows and q in rows)
            peak = " / ".join(f"{rows[p]['peak_mib']:.0f}" for p in PATHS_STEP if p in rows)
            worst = max((r.get("grad_rel", 0.0) for r in rows.values()), default=0.0)
            out.append(f"| {layout} | {ms} | {x} | {peak} | {worst:.2e} |")
        out.append("")
    return out


def sec_sweep(name: str, blob: dict) -> list[str]:
    out = [f"## Every shape: the entry points against the stock path, {blob['gpu']} ({_src(name)})", "",
           "Forward+backward wall time over the stock path's (`bench_sweep.py --report` renders the same "
           "from the file). Runs newest first; where a later run measured a cell, its number is the current one.", ""]
    for run in blob["runs"]:
        m = run["meta"]
        out += [f"### {m['date']}, {m['commit']}", ""] + _meta_lines(m) + [summary(run["rows"]), ""]
    return out


TP_METHODS = [("hooks", "`linear_logprob_entropy`"), ("hooks-policy", "`linear_policy_loss`"),
              ("stock", "stock"), ("liger-tp", "Liger TP")]


def sec_tp(name: str, blob: dict) -> list[str]:
    out = [f"## Tensor parallelism against Liger's native TP loss ({_src(name)})", ""]
    for run in blob["runs"]:
        m = run["meta"]
        shape = run["results"][0]["rows"][0]["shape"]
        out += _meta_lines(m) + ["", f"Shape {shape[0]} x {shape[1]} x {shape[2]}; forward / forward+backward ms, the slower "
                                 "rank's median; efficiency t(1) / (N t(N)) of ours against its own TP 1.", "",
                                 "| TP | SP | " + " | ".join(t for _, t in TP_METHODS) + " | efficiency, ours |",
                                 "|---" * (len(TP_METHODS) + 3) + "|"]
        base = None
        for t in run["results"]:
            for sp in (False, True):
                rows = {r["method"]: r for r in t["rows"] if r["sp"] == sp}
                if not rows:
                    continue
                ours = rows.get("hooks")
                if t["tp"] == 1 and ours:
                    base = ours
                eff = ""
                if base and ours:
                    eff = f"{base['fwd']['ms'] / (t['tp'] * ours['fwd']['ms']):.2f} / {base['fwd+bwd']['ms'] / (t['tp'] * ours['fwd+bwd']['ms']):.2f}"
                cells = [f"{rows[k]['fwd']['ms']:.2f} / {rows[k]['fwd+bwd']['ms']:.2f}" if k in rows else "" for k, _ in TP_METHODS]
                out.append(f"| {t['tp']} | {'on' if sp else 'off' if t['tp'] > 1 else '-'} | " + " | ".join(cells) + f" | {eff} |")
        out.append("")
    return out


def sec_verl(name: str, blob: dict) -> list[str]:
    out = [f"## verl's engine: the patched series against released verl ({_src(name)})", "",
           "`MegatronEngineWithLMHead.forward_step` and a backward; ms: median step, MiB: the step's peak above its start.", ""]
    m0 = blob["runs"][0]["meta"]
    out += [f"- date {m0['date']}; commit {m0.get('commit')} ({m0.get('commit_note', '')}); GPU: {m0.get('gpu')}; "
            f"torch {m0.get('torch')}, Megatron Core {m0.get('megatron_core')}, verl {m0.get('verl')}",
            "- commands (one a case): " + "; ".join(sorted({f"`{r['meta']['command']}`" for r in blob["runs"]})[:2]) + "; ...", "",
            "| hidden | case | tokens | released: path, ms, MiB | patched: path, ms, MiB |", "|---|---|---|---|---|"]
    for run in blob["runs"]:
        s = run["meta"]["shape"]
        case = ("MTP 1 layer" if s["mtp"] else "per-sample T" if s["per_sample"]
                else "uniform T, mcore-hooks everywhere" if s["mcore_hooks_everywhere"] else "uniform T")
        for n in sorted({r["tokens"] for r in run["rows"]}):
            cells = []
            for tree in ("released", "patched"):
                r = next((r for r in run["rows"] if r["tokens"] == n and r["tree"] == tree), None)
                cells.append("" if r is None else "OOM" if r.get("oom") else f"{r['path']}, {r['ms']:.1f}, {r['peak_mib']:.0f}")
            out.append(f"| {s['hidden']} | {case} | {n} | " + " | ".join(cells) + " |")
    return out + [""]


def sec_postprocess(name: str, blob: dict) -> list[str]:
    run = blob["runs"][0]
    return [f"## The post-process alone against the stock paths and Liger ({_src(name)}, plot `postprocess_{name.split('_', 1)[1].split('.')[0]}.png`)", ""] + \
        _meta_lines(run["meta"]) + [""] + postprocess_lines(run)


def sec_truncation(name: str, blob: dict) -> list[str]:
    run = blob["runs"][0]
    m = run["meta"]
    out = [f"## A truncation without top-k, its kept set by a floor ({_src(name)})", ""] + _meta_lines(m) + [
        "", f"| tokens | case | {m['base_commit']} ms / peak MiB | {m['commit']} ms / peak MiB |", "|---|---|---|---|"]
    by = {(r["tree"], r["n"], r["case"]): r for r in run["rows"]}
    for n, case in sorted({(r["n"], r["case"]) for r in run["rows"]}, key=lambda k: (k[0], list(by).index(("new",) + k))):
        cells = [f"{by[(t, n, case)]['ms']:.1f} / {by[(t, n, case)]['peak_mib']:.0f}" if (t, n, case) in by else "" for t in ("base", "new")]
        out.append(f"| {n} | {case} | " + " | ".join(cells) + " |")
    return out + [""]


def sec_gpu_tests(name: str, blob: dict) -> list[str]:
    out = [f"## GPU tests ({_src(name)})", ""]
    for run in blob["runs"]:
        results = [line.strip() for line in run["lines"] if " passed" in line or " failed" in line or line.startswith(("FAILED", "SKIPPED", "ERROR"))]
        out += _meta_lines(run["meta"]) + [f"- result: {'; '.join(results) or 'no summary line'}", ""]
    return out


def sec_logs(name: str, blob: dict) -> list[str]:
    out = [f"### {_src(name)}", ""]
    for run in blob["runs"]:
        m = run["meta"]
        out.append(f"- {m['date']}, {m['commit']}, {m['gpu']}: `{m['command']}`" + (f" (was `{m['was']}`)" if m.get("was") else ""))
    return out + [""]


SECTIONS = [("e2e_", sec_e2e), ("step_", sec_step), ("sweep_", sec_sweep), ("tp_", sec_tp), ("verl_", sec_verl),
            ("postprocess_", sec_postprocess), ("truncation_", sec_truncation), ("gpu_tests_", sec_gpu_tests)]
NOT_KEPT = ("Benchmarks with no result file here (their last numbers, measured before later kernel changes, are in "
            "RESULTS.md's history, e.g. `git show 5992123:benchmarks/RESULTS.md`): `bench_memory.py` (memory "
            "through the processors, H100, 2026-11-24), `bench_rollout.py` (rollout parity against Liger's "
            "`selected_token_ids`, H100, 2026-11-24), `bench_ops_overhead.py` (the custom ops' cost, H100, "
            "2026-11-24), `bench_mtp.py` (MTP's post-process, 2026-11-22), `profile_invariant.py` (the "
            "batch-invariant mode's cost, H100, 2026-11-25).")


def render() -> str:
    names = sorted(f for f in os.listdir(RESULTS_DIR) if f.endswith((".json", ".log")))
    lines = ["# Benchmark results", "",
             "<!-- generated by benchmarks/report.py; do not edit -->",
             "Generated by `benchmarks/report.py` from the files in `benchmarks/results/`; do not edit. "
             "Re-run a benchmark (it replaces its file), then `python benchmarks/report.py`; "
             "`python benchmarks/report.py --check` (a CPU test) fails when this file is stale.", "",
             "Every earlier measurement, in the order taken (the diary this page replaced on 2026-11-29): "
             "`git show 5992123:benchmarks/RESULTS.md`; a reference to `benchmarks/RESULTS.md` in the code or "
             "the docs for a claim not on this page means that file.", "",
             "| result file | benchmark | runs (date, commit) |", "|---|---|---|"]
    for name in names:
        blob = _load(name)
        runs = ", ".join(f"{r['meta'].get('date')} {r['meta'].get('commit')}" for r in blob["runs"])
        runs = runs if len(runs) < 120 else f"{len(blob['runs'])} runs, {min(r['meta']['date'] for r in blob['runs'])} to {max(r['meta']['date'] for r in blob['runs'])}"
        lines.append(f"| `{name}` | {blob.get('benchmark', '`' + name.rsplit('_', 1)[0] + '`')} | {runs} |")
    lines.append("")
    done = set()
    for prefix, fn in SECTIONS:
        for name in names:
            if name.startswith(prefix) and name not in done:
                done.add(name)
                lines += fn(name, _load(name))
    rest = [n for n in names if n not in done]
    if rest:
        lines += ["## Profiling logs the kernels' comments cite (no claim of their own here)", ""]
        for name in rest:
            lines += sec_logs(name, _load(name))
    lines += ["## Not kept as result files", "", NOT_KEPT, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Generate benchmarks/RESULTS.md from benchmarks/results/.")
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md differs from what would be generated")
    ap.add_argument("--out", default=RESULTS_MD)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        have = open(args.out).read() if os.path.exists(args.out) else ""
        if have != text:
            sys.stdout.writelines(list(difflib.unified_diff(have.splitlines(True), text.splitlines(True),
                                                            args.out, "generated"))[:60])
            print(f"{args.out} is stale: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
