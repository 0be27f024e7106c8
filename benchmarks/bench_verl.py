"""verl's Megatron engine on one GPU, bf16, a real vocabulary: what the patched tree
(``upstream/verl/``'s series, mcore-hooks installed) and released verl 0.9.1 each run when asked for
``use_fused_kernels=True``, at Qwen2.5-0.5B and 7B shapes, with MTP or per-sample temperatures or
neither.

    python benchmarks/bench_verl.py [--tokens 4096 16384] [--mtp 1] [--per-sample] [--iters 10] [--json out.json]
    python benchmarks/bench_verl.py --device cpu --vocab 512 --hidden 64 --ffn 128 --heads 4 --tokens 64 128

What each tree runs: with a uniform temperature and MTP off, both trees take verl's own fused path
(verl's ``fused_output_processor`` and its Triton ``linear_cross_entropy``, through Megatron's
native hook: the same code, so the two rows time it twice). With MTP on, released verl turns fused
kernels off (logits at the main head and at every MTP depth) and the patched tree runs
mcore-hooks' ``VerlFusedProcessor`` (fused at the head and the depth). With per-sample
temperatures released verl refuses fused kernels, so it runs ``use_fused_kernels=False``, and the
patched tree runs mcore-hooks' processor with one temperature per token. With
``--mcore-hooks-everywhere`` the patched tree runs mcore-hooks' processor in place of verl's at a
uniform temperature too: verl's kernel against mcore-hooks' on the same calls.

What runs is what ``tests/test_verl_series.py`` runs, with its helpers (the sdist, the series by
``git apply``, ``_engine``, ``_samples``, ``_micro_batch``), each tree in a process of its own:
``MegatronEngineWithLMHead.initialize``, then per step ``forward_step`` on one packed THD micro-batch
(nested ``input_ids``, a response ``loss_mask``, entropy on) and ``backward`` of the test's
objective (random weights on every token's log-prob and entropy; Megatron adds the MTP loss in the
backward). Unlike the test: a Qwen2.5-shaped GPTModel (by default 0.5B's: hidden 896, 14 heads / 2
groups, SwiGLU 4864; 7B's is hidden 3584, 28 / 4, 18944, vocabulary 152064), RMSNorm, RoPE, 2
layers, untied, bf16 in Megatron's ``Float16Module`` as verl's ``make_megatron_module`` wraps it;
no optimizer step. Stood in for, the same in both trees: Ray and, on the CPU, verl's platform
(``tests/verl_stubs.py``); Transformer Engine's attention (:func:`_thd_attention`); two verl modules
the engine imports and never uses (:data:`STAND_INS`).

Reported per tree and micro-batch size: the path it took (``verl`` kernel, ``mcore-hooks``
processor or ``logits``), the median ms of ``--iters`` steps after ``--warmup`` (synchronised
around each); the peak memory allocated in a step above what was allocated before it (the largest
over the steps; OOM is a result too); and the trees' agreement: the same weights (a checksum),
log-probs and entropies (max |diff|, each sequence's last token left out as in the test), the MTP
loss Megatron logs, the gradient norms of the heads and the MTP block.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import test_verl_series as series  # noqa: E402  the sdist, the series, the engine and batch helpers
import verl_stubs  # noqa: E402

PATCHED_TAR = REPO / ".whlverl" / f"verl-{series.VERL_VERSION}-patched.tar.gz"  # get_verl_wheels.sh
PATCHED_STAMP = PATCHED_TAR.parent / "verl-patched.series-sha256"
# What verl's Megatron engine imports and never uses, whose imports are not carried: datasets (and
# with it pandas, pyarrow), peft, accelerate, pillow. Stood in for, the same in both trees.
FSDP_ENGINE, DATASETS = "verl.workers.engine.fsdp", "verl.utils.dataset"
STAND_INS = {
    FSDP_ENGINE: "verl's FSDP engine (which verl.workers.engine imports; peft, accelerate, datasets)",
    DATASETS: "verl.utils.dataset's __init__ (RLHFDataset, RMDataset: datasets, pillow); the Megatron "
              "engine imports its dataset_utils, the real one",
}


# ------------------------------------------------------------------------------------- the trees
def series_digest() -> str:
    h = hashlib.sha256()
    for patch in series.SERIES:
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return h.hexdigest()


def patched_tree(where: Path, use_git: bool | None = None) -> Path:
    """The sdist with the series applied by ``git apply`` (as the test's fixture), or, where there
    is no git, the tree get_verl_wheels.sh made so, if made from this series."""
    if use_git is None:
        use_git = shutil.which("git") is not None
    if use_git:
        tree = series._unpack(series._sdist(), where / "patched")
        assert series._git(["init", "-q"], tree).returncode == 0
        for patch in series.SERIES:
            done = series._git(["apply", "--whitespace=error", f"--exclude={series.NOT_IN_THE_SDIST}", str(patch)], tree)
            if done.returncode:
                raise RuntimeError(f"{patch.name} does not apply to verl {series.VERL_VERSION}:\n{done.stderr}")
        shutil.rmtree(tree / ".git")
        return tree
    if not PATCHED_STAMP.exists() or PATCHED_STAMP.read_text().strip() != series_digest():
        raise RuntimeError(f"no git here, and {PATCHED_TAR} is missing or made from another series: "
                           "run benchmarks/get_verl_wheels.sh")
    with tarfile.open(PATCHED_TAR) as tar:
        tar.extractall(where / "patched", filter="data")
    return where / "patched" / f"verl-{series.VERL_VERSION}"


def _stand_in(name: str, path: Path | None = None) -> types.ModuleType:
    """A module of ``STAND_INS``: its names are classes that refuse to be made; with ``path``, a
    package whose submodules are the real ones there (its ``__init__`` is what is stood in for)."""

    def attribute(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr}: stood in for by benchmarks/bench_verl.py")

        return type(attr, (), {"__init__": refuse})

    module = types.ModuleType(name, f"stand-in for {STAND_INS[name]}")
    module.__getattr__ = attribute  # PEP 562
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=path is not None)
    if path is not None:
        module.__path__ = module.__spec__.submodule_search_locations = [str(path)]
    return module


def use_tree(tree: str, device: str) -> None:
    """verl from ``tree`` in this process: tests/verl_stubs.use_verl_tree (Ray stood in for; on the
    CPU, verl's platform) and ``STAND_INS``."""
    sys.path.insert(0, tree)
    sys.modules.setdefault("ray", verl_stubs.ray_stub())
    sys.modules[FSDP_ENGINE] = _stand_in(FSDP_ENGINE)
    sys.modules[DATASETS] = _stand_in(DATASETS, Path(tree, *DATASETS.split(".")))
    import verl

    assert verl.__file__.startswith(tree), (verl.__file__, tree)
    if device == "cpu":  # verl's platforms are CUDA, NPU, ROCm
        from verl.plugin.platform import platform_manager

        platform_manager._current_platform = verl_stubs._cpu_platform_class()()


# ------------------------------------------------------------------------------------- the model
def _thd_attention():
    from megatron.core.transformer.module import MegatronModule

    class ThdSdpaAttention(MegatronModule):
        """Stands in for Transformer Engine's attention (absent on the GPU machine; Megatron's own
        DotProductAttention refuses packed sequences): causal attention within each sequence of
        the THD pack, torch's SDPA (flash on the GPU) a sequence at a time, zeros for the
        padding verl may add after a sequence, as TE gives. [t, np, hn] in, [t, np * hn] out."""

        def __init__(self, config, layer_number=1, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            p = packed_seq_params
            assert p is not None and p.qkv_format == "thd", "verl's engine packs every batch (THD)"
            padded = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
            starts, lengths = padded.tolist(), (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()
            rep = query.shape[1] // key.shape[1]  # GQA: whole heads, so that flash runs
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
            pieces, at = [], 0
            for start, n in zip(starts, lengths):
                if start > at:
                    pieces.append(query.new_zeros(start - at, query.shape[1] * query.shape[2]))
                q, k, v = (x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       scale=self.softmax_scale)
                pieces.append(out[0].transpose(0, 1).reshape(n, -1))
                at = start + n
            if query.shape[0] > at:
                pieces.append(query.new_zeros(query.shape[0] - at, query.shape[1] * query.shape[2]))
            return torch.cat(pieces)

    return ThdSdpaAttention


def build_model(a, device: str):
    import copy

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
        num_query_groups=a.groups, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, mtp_num_layers=a.mtp or None, mtp_loss_scaling_factor=0.1,
        use_cpu_initialization=device == "cpu")
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = _thd_attention()
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if a.mtp else None
    if device == "cpu":  # RoPE moves its frequencies to torch.cuda.current_device(): the CPU's here
        from megatron.core.models.common.embeddings import rotary_pos_embedding

        from mcore_hooks.testing.shims import _TorchWithCpuDevice

        rotary_pos_embedding.torch = _TorchWithCpuDevice()
    torch.manual_seed(a.seed)
    model = GPTModel(config, spec, vocab_size=a.vocab, max_sequence_length=max(a.tokens),
                     position_embedding_type="rope", rotary_base=1000000,
                     share_embeddings_and_output_weights=a.tied, mtp_block_spec=mtp)
    return Float16Module(config, model.to(device)).train()  # as verl's make_megatron_module (bf16)


def _lengths(tokens: int, n: int, seed: int) -> tuple:
    """``n`` different lengths summing to ``tokens`` (each at least a quarter of the mean)."""
    g = torch.Generator().manual_seed(seed)
    shares = torch.rand(n, generator=g) + 0.25
    lengths = (shares / shares.sum() * tokens).long()
    lengths[-1] += tokens - lengths.sum()
    return tuple(lengths.tolist())


# ------------------------------------------------------------------------------ one tree (child)
def _setup(a):
    """Megatron's parallel state on one rank: on the CPU the test helpers' (gloo, Megatron's CPU
    stand-ins; entered here, left when the process ends: keep what this returns), on the GPU
    NCCL's."""
    if a.device == "cpu":
        from mcore_hooks.testing import model_parallel

        scope = model_parallel(seed=a.seed)
        scope.__enter__()
        return scope
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)


def run_tree(a) -> None:
    scope = _setup(a)  # noqa: F841  (held: its end would tear Megatron's state down)
    use_tree(a.tree_dir, a.device)
    from verl.utils.megatron_utils import unwrap_model
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    # released verl refuses fused kernels with per-sample temperatures: it is run without them
    patched, cuda = a.child == "patched", a.device == "cuda"
    fused = patched or not a.per_sample
    expect_fused = fused and (patched or not a.mtp)  # released verl turns them off with MTP
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = {"mcore-hooks": 0, "verl": 0}  # the processors' calls through the hook: which path ran
    import verl.models.mcore.model_forward_fused as mff

    if not cuda:  # verl's kernel is Triton, CUDA only: its stand-in (the formula) on the CPU
        verl_stubs.verl_kernel_on_cpu()

    verl_processor = mff.fused_output_processor

    def counted_verl(**kwargs):
        calls["verl"] += 1
        return verl_processor(**kwargs)

    mff.fused_output_processor = counted_verl
    if patched:
        from mcore_hooks.integrations.verl import VerlFusedProcessor

        process = VerlFusedProcessor.process

        def counted(self, ctx):
            calls["mcore-hooks"] += 1
            return process(self, ctx)

        VerlFusedProcessor.process = counted
        if a.mcore_hooks_everywhere:
            mff.fused_output_processor = VerlFusedProcessor()
    model = build_model(a, a.device)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    case = series.Case("bench", (1,), (a.temperature,), tied=a.tied, mtp=a.mtp, entropy=a.entropy, seed=a.seed)
    engine = series._engine(MegatronEngineWithLMHead, model, fused=fused, case=case)
    engine.initialize()
    assert engine.engine_config.use_fused_kernels is expect_fused, engine.engine_config.use_fused_kernels

    def step(batch, w1, w2):
        """verl's forward_step, then backward of the test's objective; the log-probs, entropies."""
        output, _ = engine.forward_step(iter([batch]), model, None, lambda *x, **k: None)
        lp, ent = output["log_probs"].values(), output["entropy"].values() if a.entropy else None
        objective = lp.float() * w1 + (ent.float() * w2 if a.entropy else 0)
        objective.sum().backward()
        return lp.detach(), None if ent is None else ent.detach()

    rows, values = [], {}
    for tokens in a.tokens:
        lengths = _lengths(tokens, a.sequences, a.seed + tokens)
        temperature = (tuple(0.6 + 0.2 * (i % 4) for i in range(len(lengths))) if a.per_sample
                       else (a.temperature,) * len(lengths))
        case = dataclasses.replace(case, lengths=lengths, temperature=temperature)
        ids, masks, (w1, w2) = series._samples(case, a.vocab)
        batch = series._micro_batch(case, ids, masks, expect_fused)  # on the CPU: forward_step moves it
        w1, w2 = w1.to(a.device), w2.to(a.device)
        row = {"tree": a.child, "tokens": tokens,
               "lengths": list(lengths), "device": torch.cuda.get_device_name() if cuda else "cpu",
               "model_class": type(unwrap_model(model)).__name__, "param_checksum": checksum}
        times, peaks = [], []
        calls.update({"mcore-hooks": 0, "verl": 0})
        try:
            for i in range(a.warmup + a.iters):
                model.zero_grad(set_to_none=False)  # persistent gradients, as DDP's buffer
                series._mtp_tracker()  # clears Megatron's MTP loss log
                sync()
                base = torch.cuda.memory_allocated() if cuda else 0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                lp, ent = step(batch, w1, w2)
                sync()
                if i >= a.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
                    peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None)
            grads = {n: p.grad.float().norm().item() for n, p in model.named_parameters()
                     if p.grad is not None and ("output_layer" in n or "word_embeddings" in n)}
            grads["mtp (all)"] = sum(p.grad.float().norm().item() ** 2 for n, p in model.named_parameters()
                                     if p.grad is not None and ".mtp." in n) ** 0.5
            values[tokens] = {"log_probs": series._valid(case, lp.float().cpu()),
                              "entropy": None if ent is None else series._valid(case, ent.float().cpu()),
                              "mtp": {k: v.float().cpu() for k, v in series._mtp_tracker().items()}}
            steps = a.warmup + a.iters
            row.update(path="mcore-hooks" if calls["mcore-hooks"] else "verl" if calls["verl"] else "logits",
                       processor_calls_per_step={k: v / steps for k, v in calls.items()},
                       ms=statistics.median(times), ms_all=[round(t, 2) for t in times],
                       peak_mib=max(peaks) if cuda else None, oom=False, grad_norms=grads)
            del lp, ent
        except torch.OutOfMemoryError as e:  # a result too: the path does not fit this micro-batch
            row.update(ms=None, peak_mib=None, oom=True, error=str(e).splitlines()[0])
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    torch.save({"rows": rows, "values": values}, a.result)


# -------------------------------------------------------------------------------------- the parent
def _agreement(p: dict, r: dict) -> dict:
    def diff(x, y):
        return None if x is None or y is None else (x.double() - y.double()).abs().max().item()

    out = {"logprob_max_abs_diff": diff(p["log_probs"], r["log_probs"]),
           "entropy_max_abs_diff": diff(p["entropy"], r["entropy"]),
           "mtp_loss_max_abs_diff": max((diff(p["mtp"][k], r["mtp"][k]) for k in p["mtp"] if k in r["mtp"]),
                                        default=None)}
    out["mtp_logged"] = sorted(p["mtp"]) == sorted(r["mtp"]) and bool(p["mtp"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens of each micro-batch")
    ap.add_argument("--sequences", type=int, default=4, help="packed sequences per micro-batch")
    for name, default in (("vocab", 151936), ("hidden", 896), ("ffn", 4864), ("layers", 2), ("heads", 14), ("groups", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)  # the model: Qwen2.5-0.5B's shape, 2 layers
    ap.add_argument("--mtp", type=int, default=1, help="MTP layers (trained)")
    ap.add_argument("--tied", action="store_true", help="share the embedding and output weights")
    ap.add_argument("--no-entropy", dest="entropy", action="store_false")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--mcore-hooks-everywhere", action="store_true",
                    help="the patched tree runs mcore-hooks' processor where it would run verl's (uniform "
                         "temperature, MTP off): verl's kernel against mcore-hooks' on the same calls")
    ap.add_argument("--per-sample", action="store_true",
                    help="a temperature per sample (0.6, 0.8, 1.0, 1.2, ... round the samples) instead of --temperature")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=280, help="seconds for each tree's process")
    ap.add_argument("--json", default=None,
                    help="where the rows (and meta) go (default: benchmarks/results/verl_<gpu>.json; this "
                         "case's run replaces the same case's, the other cases' stay)")
    ap.add_argument("--logs", default=None, help="keep each tree's output in this folder")
    ap.add_argument("--child", choices=("patched", "released"), help=argparse.SUPPRESS)
    ap.add_argument("--tree-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return run_tree(a)

    import megatron.core

    tmp = Path(tempfile.mkdtemp(prefix="bench_verl_"))
    trees = {"patched": patched_tree(tmp), "released": series._unpack(series._sdist(), tmp / "released")}
    results = {}
    for name, tree in trees.items():  # each tree in a process of its own: verl's module names collide
        result, log = tmp / f"{name}.pt", Path(a.logs or tmp) / f"bench_verl_{name}.log"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name, "--tree-dir", str(tree), "--result", str(result)]
        with open(log, "w") as f:  # verl prints the model, Megatron its notes: shown on failure
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
                rc = rc and f"exit status {rc}"
            except subprocess.TimeoutExpired:
                rc = f"timed out after {a.timeout} s"
        if rc:  # the other tree's numbers still come out
            print(f"{name} tree: {rc}; its output's end:\n" + "".join(open(log).readlines()[-60:]), file=sys.stderr)
        results[name] = {"rows": [], "values": {}, "error": rc} if rc else torch.load(result, weights_only=False)
    shutil.rmtree(tmp, ignore_errors=True)
    done = [r for t in results.values() for r in t["rows"]]
    meta = {"device": done[0]["device"] if done else None, "torch": torch.__version__,
            "megatron_core": megatron.core.__version__, "verl": series.VERL_VERSION,
            "series": [p.name for p in series.SERIES],
            "shape": {k: getattr(a, k) for k in ("vocab", "hidden", "ffn", "layers", "heads", "groups", "mtp",
                                                  "tied", "entropy", "sequences", "temperature", "per_sample",
                                                  "mcore_hooks_everywhere")},
            "iters": a.iters, "warmup": a.warmup, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    print(json.dumps({"meta": meta}))
    rows = []
    for tokens in a.tokens:
        p, r = (next((x for x in results[t]["rows"] if x["tokens"] == tokens),
                     {"tree": t, "path": None, "tokens": tokens, "ms": None, "peak_mib": None, "oom": False,
                      "error": results[t].get("error")}) for t in ("patched", "released"))
        vp, vr = results["patched"]["values"].get(tokens), results["released"]["values"].get(tokens)
        agree = _agreement(vp, vr) if vp and vr else {}
        if vp and vr:
            agree["same_weights"] = p["param_checksum"] == r["param_checksum"]  # both trees built them alike
            agree["grad_norm_max_rel_diff"] = max(abs(p["grad_norms"][k] - r["grad_norms"][k])
                                                  / max(r["grad_norms"][k], 1e-30) for k in r["grad_norms"])
        for row in (p, r):
            row.update(agree)
            rows.append(row)
            print(json.dumps(row))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import default_path, run_meta, write_result  # benchmarks/report.py

    meta["commit"] = run_meta()["commit"]
    meta["gpu"] = meta["device"]
    write_result(a.json or default_path("verl", gpu=meta["device"] or "cpu"), "bench_verl.py",
                 [{"meta": meta, "rows": rows}], key="shape")
    temps = "per-sample temperatures" if a.per_sample else f"temperature {a.temperature}"
    print(f"\n{meta['device']}, bf16, V={a.vocab}, H={a.hidden}, {a.layers} layers + {a.mtp} MTP (trained), "
          f"{a.sequences} packed sequences, {temps}, entropy {'on' if a.entropy else 'off'}; median of {a.iters} steps\n")
    print("| tokens | verl tree | path | fwd+bwd ms | peak MiB above pre-step | log-prob max abs diff | entropy max abs diff |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    for row in rows:
        ms = "OOM" if row["oom"] else "failed" if row.get("error") else fmt(row["ms"], ".1f")
        print(f"| {row['tokens']} | {row['tree']} | {row['path']} | {ms} | {fmt(row['peak_mib'], '.0f')} | "
              f"{fmt(row.get('logprob_max_abs_diff'), '.2e')} | {fmt(row.get('entropy_max_abs_diff'), '.2e')} |")
    for row in rows[::2]:
        if "same_weights" in row:
            print(f"\n{row['tokens']} tokens: same weights {row['same_weights']}, MTP loss logged by both "
                  f"{row['mtp_logged']} (max |diff| {fmt(row['mtp_loss_max_abs_diff'], '.2e')}), gradient norms "
                  f"(output layer, embedding, MTP) max relative diff {row['grad_norm_max_rel_diff']:.2e}, "
                  f"models {row['model_class']} (patched) / {rows[rows.index(row) + 1]['model_class']} (released), "
                  f"processor calls a step {row.get('processor_calls_per_step')} (patched) / "
                  f"{rows[rows.index(row) + 1].get('processor_calls_per_step')} (released)")


if __name__ == "__main__":
    main()
