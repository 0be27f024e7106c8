"""``upstream/verl/``'s patch series on verl 0.9.1's sdist (the release on the package registry),
run as verl runs it, on tiny stock GPTModels on the CPU, with mcore-hooks installed and hidden.

The sdist is downloaded once (sha256-checked, cached under ``$MCORE_HOOKS_CI_CACHE`` or
``~/.cache/mcore-hooks-ci``) and unpacked twice: as released, and with the series applied by
``git apply`` (that it applies cleanly, in order, is the first test; the hunks on ``docs/``,
which the sdist does not ship, are left out). Each tree is imported in ranks of its own
(``run_on_ranks``: gloo CPU ranks, fresh processes), with only what has no CPU form stood in
for: Ray, verl's accelerator platform and its Triton ``linear_cross_entropy`` kernel
(``tests/verl_stubs.py``), and under context parallelism Transformer Engine's CP attention
(:class:`ContextParallelCoreAttention`).

What runs is verl's own engine: ``MegatronEngineWithLMHead.initialize`` (forward-only, so no
optimizer: ``_maybe_enable_fused_kernels`` and the MTP patches run as in training) and
``forward_step`` on a micro-batch as verl's trainer hands it over (nested ``input_ids``, a
response ``loss_mask``, a per-sample ``temperature``). The patched tree runs the fused forward
(``use_fused_kernels=True``): verl's own ``fused_output_processor`` where it serves (a uniform
temperature, MTP off; on Megatron Core < 0.18 through the hook mcore-hooks gives the model), and
mcore-hooks' ``VerlFusedProcessor`` for MTP and per-sample temperatures. The released tree runs
its non-fused forward (logits materialised, verl's ``_lm_head_logits_processor``), which is what
it runs where the patched tree's new cases are (MTP on, per-sample temperatures), and its fused
forward where that runs (the same result bit for bit as the patched tree's). Both get the same
objective (random weights on every token's log-prob and entropy) and are compared: log-probs,
entropies, every parameter's gradient on every rank, and with MTP on the MTP losses Megatron
logs. A third reference is stock Megatron itself: the same weights, each sequence alone through
``model.forward`` (logits, divided by its temperature, ``log_softmax``).

Cases: MTP on (two depths, trained), with ``calculate_per_token_loss`` (verl's MTP loss
re-normalisation below Megatron Core 0.17, its routed-token normalization factor from 0.17), with
per-sample temperatures, and MTP on but not trained (no MTP layer runs, nothing logged, no MTP
gradient: as released); no entropy; tensor parallel 2 with sequence parallel; context parallel 2;
packed THD batches throughout (verl's engine packs every
batch); the engine's rules; and the patched tree with mcore-hooks hidden
(``sys.modules['mcore_hooks'] = None`` before verl is imported): released verl's behaviour
exactly (its fused path bit for bit where it has one, MTP falling back to the non-fused forward
with a warning, per-sample temperatures refused). The verl tests the series adds run in the
patched tree, with mcore-hooks and without. Marked ``verl_series``: the test needs verl's CPU
dependencies (``tests/verl_stubs.REQUIRED``) and fails, naming them, where they are missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from tolerances import U32, C

from cp_attention import ContextParallelCoreAttention

from mcore_hooks.testing import (
    TinyModelConfig,
    build_tiny_model,
    model_parallel,
    run_on_ranks,
)

pytestmark = pytest.mark.verl_series


@pytest.fixture(scope="module", autouse=True)
def _verl_requirements():
    """verl's CPU dependencies are the ``verl-series`` extra (``pip install -e ".[verl-series]"``):
    without it the module is skipped, saying so, unless ``MCORE_HOOKS_VERL_SERIES=required``
    (``.ci/run`` sets it where it installs the extra), where a missing package fails."""
    import verl_stubs

    missing = verl_stubs.missing_requirements()
    if missing and os.environ.get("MCORE_HOOKS_VERL_SERIES") == "required":
        pytest.fail(f"MCORE_HOOKS_VERL_SERIES=required, but verl's CPU dependencies are missing: {missing}")
    if missing:
        pytest.skip(f"verl 0.9.1's CPU dependencies are not installed ({', '.join(missing)}): "
                    'pip install -e ".[verl-series]" to run the verl patch series\' test')


@pytest.fixture(scope="module", autouse=True)
def _verl_runs_on_this_megatron():
    """verl 0.9.1's ``unwrap_model`` (every engine path) checks ``isinstance`` against Megatron
    Core's ``FullyShardedDataParallel``, which 0.20 made a function: there released verl fails
    before any forward, patched or not, so the series is tested on the releases verl supports."""
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    except ImportError:
        return
    if not isinstance(FullyShardedDataParallel, type):
        import megatron.core

        pytest.skip(f"verl 0.9.1 does not run on Megatron Core {megatron.core.__version__}: its unwrap_model "
                    "calls isinstance() with megatron.core's FullyShardedDataParallel, a function there "
                    "(released verl fails the same way)")


def test_the_verl_series_extra_is_what_verls_modules_need():
    """pyproject's ``verl-series`` extra lists exactly the requirements the stubs name."""
    import verl_stubs

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["verl-series"]
    assert sorted(extra) == sorted(verl_stubs.REQUIRED.values())

REPO = Path(__file__).resolve().parent.parent
SERIES = sorted((REPO / "upstream" / "verl").glob("*.patch"))

VERL_VERSION = "0.9.1"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/3d/"
    "f00b75ea9666b18c7ca103bbd26cfd3cfdfcbbf0ddda5debd7c3466b77f1/verl-0.9.1.tar.gz"
)
SDIST_SHA256 = "3e03d8816b2546b2c5580705671b8d0bb3f79b8364e7b5c56dbfc1245536ba22"

# ---------------------------------------------------------------------------------- tolerances
# Every value compared is float32, from the same weights and inputs by paths that differ in how
# the last step is summed: the fused kernel forms each logit (a dot of H = 32 terms), the
# log-sum-exp over V = 96 words and the entropy in chunks, where the other paths materialise the
# logits and call log_softmax; the decoders run the same operations (stock: each sequence alone,
# so its attention sums in another blocking). Bounds from tolerances.py's first-order analysis,
# times its safety factor C = 2, with this model's magnitudes (|x| ~ 1 after the final norm, init
# std 0.02: sum_h |x_h w_jh| < 0.5; coef = 1 / T <= 2; logit range D < 2):
# tolerances.logprob_error = 3 Lam + u (V + 2 D + 4 log V + H + 6), Lam = (H + 2) u coef 0.5:
# 3 * 34 u + 127 u < 2^8 u, times C.
LOGPROB_ATOL = C * 2**8 * U32  # 2^9 u ~ 3.1e-5; measured <= 16 u (0.16.1 and 0.19.2)
# the entropy's: 2 eps (1 + D + log V) (tolerances.logit_grad_error's dH), eps the log-prob's:
# 2 * 2^8 u * 7.6 < 2^12 u, times C.
ENTROPY_ATOL = C * 2**12 * U32  # 2^13 u ~ 4.9e-4; measured <= 24 u
# Gradients, norm-wise relative (the elementwise tolerances.grad_bounds needs the float64 value of
# every term, which a whole model does not expose): the logit gradient's relative error is the
# log-prob's eps plus a few u (tolerances.logit_grad_error), < 2^8 u, carried back through the
# same decoder ops on both sides, times C. Catches a wrong per-sample temperature (0.24 absolute
# in a log-prob), an MTP loss reading the output weight attached instead of detached (3.6e-3
# relative on the output layer), a dropped token or MTP depth.
GRAD_RTOL = C * 2**8 * U32  # 2^9 u ~ 3.1e-5; measured <= 8 u
# The MTP tracker's loss, per depth: sum_i m_i l_i / n over the depth's n masked tokens, l_i = -log p_i
# of that depth's head (no temperature: coef = 1, so each l_i within the log-prob's eps < 2^8 u
# above, from the same MTP hidden states on both sides), summed in float32 (K u sum|terms| with
# K = n, |l_i| <= D + log V < 6.6) and divided by n (u |value|): per side
# |error| <= eps + (n + 1) u 6.6 <= 2^8 u + 2^8 u for n <= 32 tokens (_compare_mtp checks the
# bound's premise: every MTP case has at most 32); two sides, times C: 2^11 u ~ 1.2e-4.
# The acceptance counts Megatron Core 0.19 logs beside it are integers, compared the same way.
MTP_TRACKER_MAX_TOKENS = 32
MTP_TRACKER_ATOL = C * 2 * (2**8 + 2**8) * U32  # 2^11 u ~ 1.2e-4; measured 0 u (0.16.1 and 0.19.2)


# ---------------------------------------------------------------------------------- the trees


def _cache_dir() -> Path:
    root = os.environ.get("MCORE_HOOKS_CI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mcore-hooks-ci")
    path = Path(root) / "verl-sdist"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sdist() -> Path:
    """verl 0.9.1's sdist from the cache, downloaded (and checked) on first use."""
    path = _cache_dir() / f"verl-{VERL_VERSION}.tar.gz"
    if path.exists() and _sha256(path) == SDIST_SHA256:
        return path
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")  # CI's two lines may both fetch it
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response, open(partial, "wb") as f:
            shutil.copyfileobj(response, f)
    except OSError as e:
        raise RuntimeError(f"could not download verl {VERL_VERSION}'s sdist from {SDIST_URL}: {e}") from e
    got = _sha256(partial)
    if got != SDIST_SHA256:
        partial.unlink()
        raise RuntimeError(f"verl {VERL_VERSION} sdist: sha256 {got}, expected {SDIST_SHA256}")
    partial.replace(path)
    return path


def _unpack(sdist: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(where, filter="data")
    return where / f"verl-{VERL_VERSION}"


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


class Trees(NamedTuple):
    released: str
    patched: str


# The series' hunks on files the sdist does not ship (verl's docs/): applied in a checkout of
# verl's repository (upstream/check.sh), left out here.
NOT_IN_THE_SDIST = "docs/*"


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> Trees:
    """The released tree and the patched one (the series applied with ``git apply``, in order;
    a patch that does not apply cleanly fails here, with git's message)."""
    assert SERIES, "no patch in upstream/verl/"
    sdist = _sdist()
    base = tmp_path_factory.mktemp("verl")
    released = _unpack(sdist, base / "released")
    patched = _unpack(sdist, base / "patched")
    # a repository of its own, so that git apply takes the paths relative to the sdist's root
    # whatever repository the temporary directory is in
    assert _git(["init", "-q"], patched).returncode == 0
    for patch in SERIES:
        args = ["--whitespace=error", f"--exclude={NOT_IN_THE_SDIST}", str(patch)]
        check = _git(["apply", "--check", *args], patched)
        assert check.returncode == 0, f"{patch.name} does not apply to verl {VERL_VERSION}:\n{check.stderr}"
        applied = _git(["apply", *args], patched)
        assert applied.returncode == 0, f"{patch.name}:\n{applied.stderr}"
    return Trees(str(released), str(patched))


def _added_lines(patch: Path, under: str = "") -> list[str]:
    """The lines ``patch`` adds to files whose path starts with ``under``."""
    lines, path = [], None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            path = line[len("+++ b/"):] if line.startswith("+++ b/") else None
        elif line.startswith("+") and path is not None and path.startswith(under):
            lines.append(line[1:])
    return lines


def test_the_series_applies_cleanly_and_each_patch_says_why(trees, tmp_path):
    """Applied in order by the fixture (whitespace errors refused); here: the series is all the
    patched tree differs by (reversed, last patch first, it gives back the released tree, file for
    file), each patch is a commit a maintainer can read (git format-patch's header, a subject in
    verl's ``[{modules}] {type}: {description}`` form, a why and a what), and what the sdist
    leaves out is verl's documentation only."""
    back = tmp_path / "reversed"
    shutil.copytree(trees.patched, back)
    for patch in reversed(SERIES):
        undo = _git(["apply", "--reverse", f"--exclude={NOT_IN_THE_SDIST}", str(patch)], back)
        assert undo.returncode == 0, f"{patch.name} does not reverse:\n{undo.stderr}"
    released = Path(trees.released)
    files = lambda root: {p.relative_to(root) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert files(back) == files(released)
    changed = [f for f in files(released) if (back / f).read_bytes() != (released / f).read_bytes()]
    assert not changed, changed
    for patch in SERIES:
        text = patch.read_text()
        header, _, diff = text.partition("\n---\n")
        assert header.startswith("From ") and re.search(
            r"^Subject: \[PATCH \d+/\d+\] \[[a-z_, ]+\] (feat|fix|refactor|chore|test): \S", header, re.MULTILINE
        ), patch.name
        assert re.search(r"^Why:$", header, re.MULTILINE) and re.search(r"^What:$", header, re.MULTILINE), patch.name
        assert "diff --git a/" in diff, patch.name
        paths = re.findall(r"^diff --git a/(\S+) ", diff, re.MULTILINE)
        missing = [p for p in paths if not (released / p).exists() and not (Path(trees.patched) / p).exists()]
        assert all(p.startswith("docs/") for p in missing), (patch.name, missing)


def _read(tree: str, rel: str) -> str:
    return (Path(tree) / rel).read_text()


def test_the_series_keeps_released_verl_and_writes_no_shared_state(trees):
    """What released verl has stays (the fused forward without mcore-hooks is released verl's:
    its forward copy below Megatron Core 0.18, its processor and kernel, its refusal of per-sample
    temperatures); no requirement names mcore-hooks and no module imports it at module level; and
    no line the series adds to verl's code writes a model's or config's attribute (its class, its
    config or MTP state, a method): per-call state travels in the micro-batch's own
    ``PackedSeqParams``, as verl's MTP loss normalization factor already does."""
    fused, engine = "verl/models/mcore/model_forward_fused.py", "verl/workers/engine/megatron/transformer_impl.py"
    kept = {
        fused: ["def patch_fused_forward", "def _fused_GPTModel_forward", "_LEGACY_MODE", "linear_cross_entropy(",
                "def fused_output_processor"],
        engine: ["Megatron fused kernels require a uniform temperature"],
    }
    for rel, needles in kept.items():
        for needle in needles:
            assert needle in _read(trees.released, rel) and needle in _read(trees.patched, rel), (rel, needle)
    assert "or self.model_config.mtp.enable:" in _read(trees.released, engine)
    assert "or self.model_config.mtp.enable:" not in _read(trees.patched, engine)
    for rel in ("setup.py", "pyproject.toml"):
        assert _read(trees.patched, rel) == _read(trees.released, rel), rel
    for path in sorted(Path(trees.patched, "verl").rglob("*.py")):
        top_level = re.findall(r"^(?:import|from) mcore_hooks\b", path.read_text(), re.MULTILINE)
        assert not top_level, f"{path.relative_to(trees.patched)} imports mcore_hooks at module level"
    writes = re.compile(r"\.(config|mtp_process|mtp_loss_scaling_factor|__class__|forward|_postprocess"
                        r"|output_layer|compute_language_model_loss)\s*=[^=]|setattr\((?!packed_seq_params)")
    for patch in SERIES:
        found = [line for line in _added_lines(patch, "verl/") if writes.search(line)]
        assert not found, (patch.name, found)


# ---------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple  # tokens of each sample (prompt + response)
    temperature: tuple  # one per sample
    tied: bool = True
    sp: bool = False
    mtp: int = 0  # MTP depths
    mtp_train: bool = True
    per_token_loss: bool = False  # TransformerConfig.calculate_per_token_loss (MTP loss scaling)
    entropy: bool = True  # calculate_entropy
    seed: int = 0


T = 0.7
ONE_RANK = [
    Case("packed THD", (7, 11, 5, 9), (T,) * 4),
    Case("per-sample temperatures", (9, 6, 12), (0.5, 1.0, 1.3), tied=False, seed=1),
    Case("MTP on", (10, 7, 13), (T,) * 3, tied=False, mtp=2, seed=2),
    Case("MTP on, not trained", (8, 12), (0.6, 1.2), tied=False, mtp=1, mtp_train=False, seed=3),
    Case("MTP on, per-token loss", (9, 12, 8), (T,) * 3, tied=False, mtp=2, per_token_loss=True, seed=7),
    Case("MTP on, per-sample temperatures", (8, 11, 9), (0.6, 1.1, 0.9), mtp=1, seed=9),
    Case("no entropy", (6, 10, 8), (0.9,) * 3, entropy=False, seed=8),
]
# With calculate_per_token_loss, verl's trainer hands the engine the batch's loss-token count and
# the count Megatron finalizes against (routed): from Megatron Core 0.17 the MTP loss scale is
# multiplied by routed / batch (verl's _get_mtp_loss_config, the series' _mtp_loss_normalization).
BATCH_NUM_TOKENS, ROUTED_NUM_TOKENS = 20, 15
TP2_SP = Case("TP 2 + SP, per-sample temperatures", (7, 10, 5), (0.6, 1.0, 1.4), sp=True, seed=4)
CP2 = Case("CP 2, per-sample temperatures", (9, 14, 6), (0.8, 1.2, 0.5), tied=False, seed=5)


def _tiny(cfg: TinyModelConfig):
    """A tiny stock GPTModel (same seed: same weights) without learned absolute positions: verl's
    engine passes no position ids for a packed batch (its models use RoPE), and the CPU model's
    attention takes its causal mask from the packing."""
    model = build_tiny_model(cfg)
    model.embedding.add_position_embedding = False
    return model.train()


def _tiny_cp(cfg: TinyModelConfig):
    """The tiny model on context-parallel ranks: ``build_tiny_model``'s construction (same
    weights as on one rank: made on the CPU from the seed) less its refusal of CP, with
    :class:`ContextParallelCoreAttention` in every layer."""
    from megatron.core import parallel_state

    from mcore_hooks.testing import cpu_shims
    from mcore_hooks.testing import models as tiny

    with cpu_shims():
        tiny._ensure_rng_tracker_seeded(cfg.seed)
        model = tiny._cast(tiny._construct(cfg, tiny.stock_model_class("gpt"), tiny._transformer_config(cfg, 1)), cfg)
    group = parallel_state.get_context_parallel_group()
    for layer in model.decoder.layers:
        layer.self_attention.core_attention = ContextParallelCoreAttention(layer.self_attention.core_attention, group)
    model.embedding.add_position_embedding = False
    return model.train()


def _samples(case: Case, vocab: int):
    g = torch.Generator().manual_seed(case.seed)
    ids = [torch.randint(1, vocab, (n,), generator=g) for n in case.lengths]
    masks = []
    for n in case.lengths:
        prompt = max(1, n // 3)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[prompt:] = torch.rand(n - prompt, generator=g) > 0.15
        masks.append(mask)
    total = sum(case.lengths)
    weights = (torch.rand(total, generator=g), torch.rand(total, generator=g))
    weights[0][_last_positions(case)] = 0.0  # see _last_positions
    return ids, masks, weights


def _last_positions(case: Case) -> torch.Tensor:
    """Each sequence's last token: its label is not the sequence's (verl rolls the packed buffer
    as a whole: the next sequence's first token, or the padding's), and no loss reads it; the
    objective gives its log-prob no weight, and comparisons with stock leave it out."""
    return torch.tensor(case.lengths).cumsum(0) - 1


def _valid(case: Case, t: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(t.shape[0], dtype=torch.bool)
    keep[_last_positions(case)] = False
    return t[keep]


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _engine(cls, model, *, fused: bool, case: Case):
    """verl's Megatron engine around ``model`` as ``MegatronEngine.__init__`` leaves it, less what
    needs a checkpoint or Megatron-Bridge: its configs (the fields the forward reads), and
    ``_build_tf_config`` / ``_build_megatron_module`` giving this model."""
    from megatron.core import parallel_state as mpu
    from verl.workers.config import MtpConfig

    engine = object.__new__(cls)
    engine.model_config = SimpleNamespace(
        mtp=MtpConfig(enable=case.mtp > 0, enable_train=case.mtp_train),
        hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        model_type="language_model",
    )
    engine.engine_config = SimpleNamespace(
        use_fused_kernels=fused, use_remove_padding=True, forward_only=True, override_transformer_config={},
        dynamic_context_parallel=False, pad_to_length=False, pad_to_length_bucket=None,
        entropy_from_logits_with_chunking=False, entropy_from_logits_chunk_size=2048,
        context_parallel_size=mpu.get_context_parallel_world_size(),
    )
    engine.is_value_model = False
    engine.enable_routing_replay = False
    engine._qat_enabled = False
    engine._is_offload_param = engine._is_offload_optimizer = False
    engine._build_tf_config = lambda: setattr(engine, "tf_config", model.config)
    engine._build_megatron_module = lambda: [model]
    return engine


def _micro_batch(case: Case, ids, masks, fused: bool):
    from verl.utils import tensordict_utils as tu

    nested = lambda xs: torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)
    extra = {"batch_num_tokens": BATCH_NUM_TOKENS, "routed_num_tokens": ROUTED_NUM_TOKENS} if case.per_token_loss else {}
    return tu.get_tensordict(
        {"input_ids": nested(ids), "loss_mask": nested(masks), "temperature": torch.tensor(case.temperature)},
        {"calculate_entropy": case.entropy, "use_fused_kernels": fused, **extra},
    )


def _mtp_tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = {k: v.detach().clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
    MTPLossLoggingHelper.tracker.clear()
    return values


def _case_model(case: Case):
    """The tiny model of ``case`` on this rank's parallel layout (same seed: same weights)."""
    from megatron.core import parallel_state

    cfg = TinyModelConfig(tied=case.tied, sequence_parallel=case.sp, mtp_num_layers=case.mtp)
    model = _tiny_cp(cfg) if parallel_state.get_context_parallel_world_size() > 1 else _tiny(cfg)
    model.config.calculate_per_token_loss = case.per_token_loss
    return model


def _verl_case(fused: bool, case: Case, model=None, expect_fused: bool | None = None) -> dict:
    """verl's engine (the tree this process imported) on ``case``: log-probs, entropies (global
    token order; None without), every gradient of the objective, the MTP tracker. ``model``:
    built here unless given; ``expect_fused``: what ``use_fused_kernels`` is after ``initialize``
    (``fused`` unless given)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    model = _case_model(case) if model is None else model
    expect_fused = fused if expect_fused is None else expect_fused
    engine = _engine(MegatronEngineWithLMHead, model, fused=fused, case=case)
    engine.initialize()
    assert engine.engine_config.use_fused_kernels is expect_fused, engine.engine_config.use_fused_kernels
    ids, masks, (w1, w2) = _samples(case, TinyModelConfig().vocab_size)
    MTPLossLoggingHelper.tracker.clear()
    batch = _micro_batch(case, ids, masks, expect_fused)
    output, _ = engine.forward_step(iter([batch]), model, None, lambda *a, **k: None)
    lp = output["log_probs"].values()
    assert lp.shape == (sum(case.lengths),)
    objective = lp.float() * w1
    ent = None
    if case.entropy:
        ent = output["entropy"].values()
        assert ent.shape == lp.shape
        objective = objective + ent.float() * w2
    else:
        assert "entropy" not in output, sorted(output)
    objective.sum().backward()
    return {"log_probs": lp.detach().float(), "entropy": None if ent is None else ent.detach().float(),
            "grads": _grads(model), "mtp": _mtp_tracker(), "fused_class": type(model).__name__,
            "sp_params": {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}}


def _stock_case(case: Case, tp: int) -> dict:
    """Stock Megatron on the same weights: each sequence alone through ``model.forward`` (padded
    at its end to a multiple of ``tp``: causal, so nothing before the padding changes), its logits
    (gathered over TP) divided by its temperature, ``log_softmax``; labels as verl rolls them
    within each sequence (the last token's label is its sequence's first). No MTP (a stock
    forward without labels cannot run it before 0.19): a copy without MTP shares the layers."""
    cfg = TinyModelConfig(tied=case.tied, sequence_parallel=case.sp, mtp_num_layers=case.mtp)
    stock = _tiny(cfg)
    head = stock
    if case.mtp:
        head = _tiny(dataclasses.replace(cfg, mtp_num_layers=0))
        head.embedding, head.decoder, head.output_layer = stock.embedding, stock.decoder, stock.output_layer
    ids, _, (w1, w2) = _samples(case, cfg.vocab_size)
    lps, ents = [], []
    for seq, t in zip(ids, case.temperature):
        n = seq.numel()
        padded = -(-n // tp) * tp
        x = torch.zeros(1, padded, dtype=torch.long)
        x[0, :n] = seq
        causal = torch.ones(padded, padded, dtype=torch.bool).triu(1).view(1, 1, padded, padded)
        logits = head(input_ids=x, position_ids=torch.arange(padded).unsqueeze(0), attention_mask=causal,
                      runtime_gather_output=True)[0, :n].float()
        logp = torch.log_softmax(logits / t, dim=-1)
        lps.append(logp.gather(-1, seq.roll(-1).unsqueeze(-1)).squeeze(-1))
        ents.append(-(logp.exp() * logp).sum(-1))
    lp, ent = torch.cat(lps), torch.cat(ents)
    (lp * w1 + (ent * w2 if case.entropy else 0)).sum().backward()
    return {"log_probs": lp.detach(), "entropy": ent.detach() if case.entropy else None, "grads": _grads(stock)}


def _rank(tree: str, fused: bool, cases: list, with_stock: bool, hidden: list | None = None,
          rules: bool = False) -> dict:
    """One rank: import verl from ``tree``, run ``cases`` through its engine (and stock Megatron
    on the same ranks); with ``hidden``, first (before anything imports verl) the tree with
    mcore-hooks hidden on those cases; with ``rules`` the engine's rules."""
    import verl_stubs

    out: dict[str, Any] = {}
    if hidden is not None:
        out["without_mcore_hooks"] = _without_mcore_hooks(tree, hidden)
    verl_stubs.use_verl_tree(tree)
    verl_stubs.verl_kernel_on_cpu()
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    out["verl"] = [_verl_case(fused, c) for c in cases]
    if with_stock:
        out["stock"] = [_stock_case(c, tp) for c in cases]
    if rules:
        out["rules"] = _engine_rules()
    return out


class _Warnings(logging.Handler):
    """The messages of the warnings a logger emits while this handler is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _without_mcore_hooks(tree: str, cases: list) -> dict:
    """The patched tree with mcore-hooks hidden: every ``mcore_hooks`` module in ``sys.modules`` is
    None (``import mcore_hooks...`` raises ImportError) while verl is first imported and run,
    restored afterwards (the test's own tiny-model builder is mcore-hooks': the models are built
    before). For each case, verl's engine asked for fused kernels: what it ran (fused, or the
    non-fused forward it fell back to) and its results, or the NotImplementedError it raised; the
    warnings its logger gave."""
    import sys

    import verl_stubs

    models = [_case_model(case) for case in cases]
    hidden = {name: m for name, m in sys.modules.items() if name == "mcore_hooks" or name.startswith("mcore_hooks.")}
    sys.modules.update(dict.fromkeys(hidden))
    try:
        with pytest.raises(ImportError):
            import mcore_hooks.integrations.verl  # noqa: F401
        verl_stubs.use_verl_tree(tree)
        verl_stubs.verl_kernel_on_cpu()
        from verl.workers.engine.megatron import transformer_impl as impl

        warnings = _Warnings()
        impl.logger.addHandler(warnings)
        results = []
        try:
            for case, model in zip(cases, models):
                expect_fused = not case.mtp  # released verl turns fused kernels off with MTP
                try:
                    results.append(_verl_case(True, case, model=model, expect_fused=expect_fused))
                except NotImplementedError as e:
                    results.append(str(e))
        finally:
            impl.logger.removeHandler(warnings)
        return {"results": results, "warnings": warnings.messages}
    finally:
        sys.modules.update(hidden)


def _raised(fn, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)``'s NotImplementedError message ("" if it returned)."""
    try:
        fn(*args, **kwargs)
    except NotImplementedError as e:
        return str(e) or "NotImplementedError"
    return ""


def _engine_rules() -> dict:
    """The patched engine's choices that no forward shows: fused kernels stay on with MTP
    (mcore-hooks installed), and the temperature the fused forward gets (or its refusal)."""
    from verl.workers.engine.megatron import transformer_impl as impl

    model = _tiny(TinyModelConfig(mtp_num_layers=1))
    engine = _engine(impl.MegatronEngineWithLMHead, model, fused=True, case=Case("rules", (4,), (1.0,), mtp=1))
    engine.module = [model]
    engine._maybe_enable_fused_kernels()
    resolve = impl._resolve_fused_temperature
    per_sample = torch.tensor([0.5, 0.0, 1.3])
    return {
        "mtp": engine.engine_config.use_fused_kernels,
        "mtp class": type(model).__name__,
        "uniform": resolve(torch.tensor([0.7, 0.7, 0.7]), per_sample=True),
        "float": resolve(0.9, per_sample=True),
        "per sample": resolve(per_sample, per_sample=True),
        "refused: per sample without mcore-hooks": _raised(resolve, per_sample),
    }


# ---------------------------------------------------------------------------------- comparisons


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float) -> float:
    err = (got.double() - ref.double()).abs().max().item()
    assert got.shape == ref.shape and err <= atol, f"{name}: max |diff| {err:.3g} > {atol:.3g}"
    return err


def _close_grads(name: str, got: dict, ref: dict) -> float:
    """Every parameter's gradient, norm-wise relative; the same parameters get one (a parameter
    without a gradient on one side has none on the other)."""
    missing = ref.keys() - got.keys()
    assert not missing, f"{name}: no gradient for {sorted(missing)}"
    extra = got.keys() - ref.keys()
    assert not extra, f"{name}: gradients the reference has not: {sorted(extra)}"
    worst = 0.0
    for n in ref:
        rel = ((got[n].double() - ref[n].double()).norm() / ref[n].double().norm().clamp(min=1e-30)).item()
        assert rel <= GRAD_RTOL, f"{name}: {n}: relative error {rel:.3g} > {GRAD_RTOL:.3g}"
        worst = max(worst, rel)
    return worst


def _compare(name: str, got: dict, ref: dict, case: Case, grads: bool = True) -> None:
    _close(f"{name}: log-probs", _valid(case, got["log_probs"]), _valid(case, ref["log_probs"]), LOGPROB_ATOL)
    if case.entropy:
        _close(f"{name}: entropies", got["entropy"], ref["entropy"], ENTROPY_ATOL)
    else:
        assert got["entropy"] is None and ref["entropy"] is None, name
    if grads:
        _close_grads(f"{name}: gradients", got["grads"], ref["grads"])


def _compare_mtp(name: str, got: dict, ref: dict, case: Case) -> None:
    """The MTP tracker (every depth's logged loss; 0.19: acceptance counts) against the reference's,
    within MTP_TRACKER_ATOL, whose derivation holds for cases of at most MTP_TRACKER_MAX_TOKENS."""
    assert sum(case.lengths) <= MTP_TRACKER_MAX_TOKENS, f"{name}: MTP_TRACKER_ATOL assumes <= 32 tokens"
    assert got.keys() == ref.keys() and got, f"{name}: MTP tracker {sorted(got)} vs {sorted(ref)}"
    for k in got:
        _close(f"{name}: MTP tracker {k}", got[k], ref[k], MTP_TRACKER_ATOL)


def _runs_fused_in_released_verl(case: Case) -> bool:
    """Released verl's fused forward takes a uniform temperature and no MTP."""
    return not case.mtp and len(set(case.temperature)) == 1


FUSED_IN_RELEASED = [c for c in ONE_RANK if _runs_fused_in_released_verl(c)]


def _native_hook() -> bool:
    from mcore_hooks import compat

    return compat.has_native_hook(compat.model_class("gpt"))


def _same_bits(name: str, got: dict, ref: dict) -> None:
    for key in ("log_probs", "entropy"):
        assert (got[key] is None) == (ref[key] is None), (name, key)
        assert got[key] is None or torch.equal(got[key], ref[key]), f"{name}: {key} differ"
    assert got["grads"].keys() == ref["grads"].keys(), name
    for n in ref["grads"]:
        assert torch.equal(got["grads"][n], ref["grads"][n]), f"{name}: gradient of {n} differs"
    assert got["mtp"].keys() == ref["mtp"].keys() and all(torch.equal(got["mtp"][k], ref["mtp"][k]) for k in got["mtp"])


@pytest.fixture(scope="module")
def one_rank(trees):
    patched = run_on_ranks(_rank, 1, trees.patched, True, ONE_RANK, True, ONE_RANK, True)[0]
    released = run_on_ranks(_rank, 1, trees.released, False, ONE_RANK, False)[0]
    released_fused = run_on_ranks(_rank, 1, trees.released, True, FUSED_IN_RELEASED, False)[0]
    return patched, released, dict(zip((c.name for c in FUSED_IN_RELEASED), released_fused["verl"]))


@pytest.mark.parametrize("index", range(len(ONE_RANK)), ids=[c.name for c in ONE_RANK])
def test_one_rank(one_rank, index):
    """tp = cp = 1: the patched fused forward against verl's released non-fused forward (values,
    every gradient, the logged MTP losses) and against stock Megatron (values; every gradient
    where MTP is off: the stock reference runs no MTP); where released verl has a fused path, the
    patched one gives its bits."""
    case = ONE_RANK[index]
    patched, released, released_fused = one_rank
    got, ref, stock = patched["verl"][index], released["verl"][index], patched["stock"][index]
    # the model's class: switched by mcore-hooks where the hook or the MTP depths' fused loss needs
    # it (below Megatron Core 0.18; MTP on), Megatron's own where its native hook serves
    switched = bool(case.mtp) or not _native_hook()
    assert got["fused_class"] == ("HookedGPTModel" if switched else "GPTModel"), got["fused_class"]
    assert ref["fused_class"] == "GPTModel", ref["fused_class"]
    _compare(f"{case.name} vs released verl", got, ref, case)
    _compare(f"{case.name} vs stock", got, stock, case, grads=case.mtp == 0)
    if case.name in released_fused:
        _same_bits(f"{case.name} vs released verl's fused forward", got, released_fused[case.name])
    mtp_grads = sorted(n for n in got["grads"] if n.startswith("mtp."))
    if case.mtp and case.mtp_train:
        _compare_mtp(case.name, got["mtp"], ref["mtp"], case)
        assert mtp_grads, f"{case.name}: no MTP parameter got a gradient"
    else:
        # MTP off, or not trained: released verl skips the MTP block (its _postprocess without
        # labels), and so does the fused forward: nothing logged, no MTP parameter's gradient
        assert not got["mtp"] and not ref["mtp"], (sorted(got["mtp"]), sorted(ref["mtp"]))
        assert not mtp_grads and not any(n.startswith("mtp.") for n in ref["grads"]), mtp_grads


@pytest.mark.parametrize("index", range(len(ONE_RANK)), ids=[c.name for c in ONE_RANK])
def test_without_mcore_hooks_the_patched_tree_is_released_verl(one_rank, index):
    """The patched tree with mcore-hooks hidden, asked for fused kernels: with MTP on it falls
    back to the non-fused forward, warning (released verl's results, bit for bit); per-sample
    temperatures are refused, as released; otherwise verl's own fused forward runs (released
    verl's fused results, bit for bit)."""
    case = ONE_RANK[index]
    patched, released, released_fused = one_rank
    hidden = patched["without_mcore_hooks"]
    got = hidden["results"][index]
    if case.mtp:
        assert any("need mcore-hooks" in m for m in hidden["warnings"]), hidden["warnings"]
        assert got["fused_class"] == "GPTModel", got["fused_class"]
        _same_bits(f"{case.name}, without mcore-hooks vs released verl", got, released["verl"][index])
    elif not _runs_fused_in_released_verl(case):
        assert isinstance(got, str) and "uniform temperature" in got, got
    else:
        assert got["fused_class"] == "GPTModel", got["fused_class"]
        _same_bits(f"{case.name}, without mcore-hooks vs released verl's fused forward", got, released_fused[case.name])


def test_engine_rules(one_rank):
    """Fused kernels stay on with MTP (mcore-hooks installed: the model's class switched for the
    depths' fused loss); a uniform temperature stays a float, per-sample ones become one per
    sample, non-positive ones 1e-8 as in the non-fused path; without mcore-hooks they are refused
    as released, saying what to install."""
    rules = one_rank[0]["rules"]
    assert rules["mtp"] is True and rules["mtp class"] == "HookedGPTModel", rules
    assert isinstance(rules["uniform"], float) and abs(rules["uniform"] - 0.7) < 1e-7
    assert isinstance(rules["float"], float) and rules["float"] == pytest.approx(0.9)
    torch.testing.assert_close(rules["per sample"], torch.tensor([0.5, 1e-8, 1.3]), rtol=0, atol=0)
    refused = rules["refused: per sample without mcore-hooks"]
    assert "uniform temperature" in refused and "mcore-hooks" in refused, refused


def _added_tests() -> list[str]:
    """The verl test files the series adds (new files under ``tests/``)."""
    added = []
    for patch in SERIES:
        added += re.findall(r"^--- /dev/null\n\+\+\+ b/(tests/\S+\.py)$", patch.read_text(), re.MULTILINE)
    return added


@pytest.mark.parametrize("hidden", [False, True], ids=["with mcore-hooks", "mcore-hooks hidden"])
def test_the_tests_the_series_adds_to_verl_pass(trees, hidden):
    """verl's tests that the series adds (verl's layout and style: ``tests/**/test_*_on_cpu.py``,
    mocks where the engine needs a cluster) pass in the patched tree, with mcore-hooks installed
    and with it hidden (the ones that need it skip, saying so)."""
    import sys

    tests = _added_tests()
    assert tests and all(t.endswith("_on_cpu.py") for t in tests), tests
    env = dict(os.environ, MCORE_HOOKS_VERL_TREE=trees.patched, MCORE_HOOKS_HIDDEN="1" if hidden else "0",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "verl_tree_plugin",
                          "-o", "addopts=", *tests], cwd=trees.patched, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary


def test_tensor_parallel_2_with_sequence_parallel(trees):
    """TP 2 + SP: on each rank, values (the same on both) and every gradient shard against
    released verl's on the same rank, and against stock Megatron's on the same rank; the
    sequence-parallel parameters' gradients (norms, biases: each rank's is a partial sum over its
    token shard, which the packed batch and stock's sequences cut differently) summed over the
    ranks, as Megatron's finalize_model_grads all-reduces them."""
    patched = run_on_ranks(_rank, 2, trees.patched, True, [TP2_SP], True, tp=2)
    released = run_on_ranks(_rank, 2, trees.released, False, [TP2_SP], False, tp=2)
    sp = patched[0]["verl"][0]["sp_params"]
    assert sp, "no sequence-parallel parameter: is SP on?"
    for rank, (p, r) in enumerate(zip(patched, released)):
        _compare(f"rank {rank}: {TP2_SP.name} vs released verl", p["verl"][0], r["verl"][0], TP2_SP)
        got = {**p["verl"][0], "grads": {n: g for n, g in p["verl"][0]["grads"].items() if n not in sp}}
        stock = {**p["stock"][0], "grads": {n: g for n, g in p["stock"][0]["grads"].items() if n not in sp}}
        _compare(f"rank {rank}: {TP2_SP.name} vs stock", got, stock, TP2_SP)
    summed = lambda which: {n: sum(x[which][0]["grads"][n] for x in patched) for n in sp}
    _close_grads(f"{TP2_SP.name}: sequence-parallel gradients vs stock", summed("verl"), summed("stock"))


def test_context_parallel_2(trees):
    """CP 2 with per-sample temperatures (verl's zigzag THD split, its all-gather of the outputs):
    values on both ranks and each rank's gradient against released verl's non-fused forward; the
    ranks' gradients summed (Megatron all-reduces them over DP x CP) against stock Megatron's
    unsplit run. The fused forward lays the temperatures out with the call that lays out the
    labels, so the processor needs no knowledge of the layout. (verl's contiguous layout needs a
    Megatron Core whose PackedSeqParams has ``cp_partition_mode``, which no release has yet.)"""
    case = CP2
    patched = run_on_ranks(_rank, 2, trees.patched, True, [case], False, tp=1, cp=2)
    released = run_on_ranks(_rank, 2, trees.released, False, [case], False, tp=1, cp=2)
    for rank, (p, r) in enumerate(zip(patched, released)):
        _compare(f"rank {rank}: {case.name} vs released verl", p["verl"][0], r["verl"][0], case)
    with model_parallel(tp=1):
        stock = _stock_case(case, 1)
    summed = {n: sum(p["verl"][0]["grads"][n] for p in patched) for n in patched[0]["verl"][0]["grads"]}
    _compare(f"{case.name} vs stock", {**patched[0]["verl"][0], "grads": summed}, stock, case)
