"""``upstream/nemo-rl/``'s patch series on NeMo RL at 7ea279ab, run as NeMo RL runs it, on tiny
stock GPTModels on the CPU.

Needs a NeMo RL checkout at that commit (github.com/NVIDIA-NeMo/RL, which CI cannot fetch): set
``MCORE_HOOKS_NEMO_RL_CHECKOUT`` to its path; without it every test here is skipped, saying so.
The checkout is copied twice, as it is and with the series applied by ``git apply`` (``--check``
first, in order: the first thing tested), and each tree is imported in ranks of its own
(``run_on_ranks``: gloo CPU ranks, fresh processes), with only what has no CPU form stood in for
(``tests/nemo_rl_stubs.py``: Ray, Megatron-Bridge, the experiment trackers, and three Megatron
Core 0.20 names that 0.16 / 0.19 lack).

What runs is NeMo RL's own Megatron train path, ``nemo_rl.models.megatron.train``:
``forward_with_post_processing_fn`` on a ``ProcessedMicrobatch`` (packed and CP-sharded by NeMo
RL's own ``_pack_sequences_for_megatron``), then the post-processor it returns, for
``get_logprobs`` (``LogprobsPostProcessor``: ``[B, S]`` log-probs) and for training
(``LossPostProcessor`` with ``NLLLossFn``: its loss wrappers, ``SequencePackingLossWrapper`` or,
with ``fuse_loss``, ``SequencePackingFusionLossWrapper``), and a backward of the loss scaled as
Megatron's schedule scales it. The patched tree runs the fused path
(``use_fused_linear_logprobs=True``: ``NemoRLLogprobProcessor`` through the model's
``output_processor`` hook, the model given the hook by ``mcore_hooks.enable_output_processor`` as
the patched ``setup.py`` does); the unpatched tree runs NeMo RL's own non-fused path (logits
materialised, ``apply_temperature_scaling`` on the logits, ``get_next_token_logprobs_from_logits``
/ ``from_parallel_logits_to_logprobs_packed_sequences``). A third reference is stock Megatron: the
same weights, the unpacked ``[B, S]`` batch through ``model.forward`` (logits gathered over TP,
divided by the temperature, ``log_softmax``, the next token), its NLL. Compared: the log-probs,
the loss, and every parameter's gradient on every rank.

Cases: one rank (untied and tied output weights), TP 2, TP 2 with sequence parallel, packed THD
(both loss wrappers), TP 2 + SP packed, CP 2 with packing (both loss wrappers), and MTP (2
depths; 1 depth, packed: the depths trained as the logits path trains them), all at temperature
0.7. NeMo RL's non-fused path cannot run under CP on a CPU (``AllGatherCPTensor``'s backward moves
an index to CUDA), so CP 2 is compared with its one-rank run on the same packed batch (the
gradients summed over the CP ranks, as data-parallel-and-context-parallel gradient reduction sums
them). The series' own additions to NeMo RL's unit tests run too, in the patched tree. NeMo RL has one temperature per run (``TrainingSamplingParams.temperature``
is a float), so there is no per-sample temperature case (checked, so that one gets added when
NeMo RL gets them).

Also: the released fused path (the class-wide forward patch) as a negative control (at T = 0.7
its log-probs are the divided ones, far from both; at T = 1 it equals the patched one), the
output layer's forward pre-hooks (what ``overlap_param_gather`` needs: a stand-in for the
distributed optimizer's all-gather wait), and setup's refusals (present unpatched, gone patched).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple, Optional

import pytest
import torch

from cp_attention import ContextParallelCoreAttention

from mcore_hooks.testing import TinyModelConfig, build_tiny_model, run_on_ranks
from tolerances import U32

ENV = "MCORE_HOOKS_NEMO_RL_CHECKOUT"
COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
REPO = Path(__file__).resolve().parent.parent
SERIES = sorted((REPO / "upstream" / "nemo-rl").glob("*.patch"))

pytestmark = pytest.mark.skipif(
    not os.environ.get(ENV),
    reason=f"{ENV} is not set: these tests apply upstream/nemo-rl/ to a NeMo RL checkout at "
    f"{COMMIT[:8]} (github.com/NVIDIA-NeMo/RL), which CI cannot fetch; set {ENV} to its path",
)

# The files the series touches, as they are at 7ea279ab (git's blob ids): checked, so the
# checkout is that commit's tree whether or not it is a git repository.
BASE_BLOBS = {
    "docs/guides/dpo.md": "3187578601ee200f53ee55fe2bb1e057d70eeefa",
    "docs/guides/grpo.md": "4b164a3c189716e6add9db61eb8e27f5948ca278",
    "docs/guides/sft.md": "07a924183d036e164286edd53c6897d3e440badf",
    "examples/configs/recipes/llm/dpo-qwen2.5-math7b-1n8g-megatron_fused_linear_logprobs.yaml":
        "7b35884b2ac3660cd6e34dd5b99f809ffff4caa5",
    "examples/configs/recipes/llm/sft-qwen2.5-math7b-1n8g-megatron_fused_linear_logprobs.yaml":
        "13aa035938bb8cf1061b58e341b899383a0fe0a0",
    "nemo_rl/algorithms/dpo.py": "de0a60af265a484e96fa24d6752f8744f8f341f9",
    "nemo_rl/algorithms/grpo.py": "dd49d0db6205c567b0cc4dfbac0c6b5e8eb13806",
    "nemo_rl/algorithms/loss/loss_functions.py": "11e68df88dcb7a9a4549c4574afa2ad301a6a540",
    "nemo_rl/algorithms/loss/utils.py": "ca543a9485c3eb5c4d589581ae3453170c6c94cd",
    "nemo_rl/algorithms/loss/wrapper.py": "344c0a3ec1075ef17ec3ccb9650295266d0b258d",
    "nemo_rl/distributed/model_utils.py": "7195592e25ff09fae255d0f0394ad3cb02eead6c",
    "nemo_rl/models/megatron/setup.py": "913356d2a452e41e457092583c0570caa8ee2338",
    "nemo_rl/models/megatron/train.py": "6e2cfd6e6a1eef602914203da824d9edd61e6bd5",
    "nemo_rl/models/policy/__init__.py": "a494807b113a5866cbf8d1010489a724b54473c3",
    "nemo_rl/models/policy/workers/megatron_policy_worker.py": "032b9b32893b36aad43c57872dee9d9f1ef2ef11",
    "pyproject.toml": "00a6822e923eec54ef76fca79783d5e95ebf6ee4",
    "tests/unit/algorithms/test_sequence_packing_fusion.py": "a979cbff5daf537a356d6d7b6508873f9703310d",
    "tests/unit/distributed/test_model_utils.py": "72f626c001f2d7b9a23c75c5ce25796d4eface87",
    "tests/unit/models/megatron/test_train.py": "130cbf9825b206a81c62c3f050da690a2eba8d34",
}

# The unit tests the series adds to NeMo RL's own suite (mock-based, CPU).
SERIES_UNIT_TESTS = [
    "tests/unit/models/megatron/test_train.py::TestModelForward::test_model_forward_with_output_processor",
    "tests/unit/models/megatron/test_train.py::TestForwardWithPostProcessingFn::"
    "test_forward_with_fused_linear_logprobs_passes_the_processor",
    "tests/unit/models/megatron/test_train.py::TestForwardWithPostProcessingFn::"
    "test_forward_fused_linear_logprobs_take_the_temperature_on_the_logits",
    "tests/unit/models/megatron/test_train.py::TestLogprobsPostProcessor::"
    "test_logprobs_post_processor_fused_with_packing",
    "tests/unit/distributed/test_model_utils.py::test_unpack_next_token_logprobs",
    "tests/unit/algorithms/test_sequence_packing_fusion.py::"
    "test_sequence_packing_loss_wrapper_slices_fused_logprobs_globally",
    "tests/unit/algorithms/test_sequence_packing_fusion.py::test_prepare_packed_loss_input_unpacks_fused_logprobs",
]

# ---------------------------------------------------------------------------------- tolerances
# Every value compared is float32, from the same weights and inputs, by paths that differ in how
# the last step is summed: the fused kernel forms each logit (a dot of H = 32 terms), the
# log-sum-exp over V = 96 words in chunks of 4 tokens; the logits path materialises the logits and
# takes a (vocab-parallel) log-softmax. tolerances.logprob_error bounds one token's log-prob error
# against exact arithmetic by 3 Lam + u (V + 2 D + 4 log V + H + 6), with
# Lam = (H + 2) u coef max_j sum_h |x_h w_jh|: here |x| ~ 1 (after the final norm), |w| ~ 0.02
# (init), coef = 1 / T = 1.43, so Lam < 34 * 1.43 * 2 u ~ 97 u and the bound is < 2^9 u; two paths
# each within it differ by < 2^10 u. The decoder runs the same operations on every path, except
# that packed (THD) attention, TP's all-reduces and CP's gathered keys sum in another order: a few
# ulps in the hidden states, which the bound's margin (measured differences ~2^4 u) covers.
LOGPROB_ATOL = 2**10 * U32  # ~6.1e-5
# Gradients, norm-wise: each parameter's gradient sums, over every token of the batch (<= 48),
# products whose terms carry the error above; relative to the gradient's norm the accumulated
# rounding stays within K u, K the tokens times the dot length (48 * 32 < 2^11); 2^12 u ~ 2.4e-4
# (elementwise bounds, tolerances.grad_bounds, need every term's float64 reference, which an
# end-to-end model does not expose). A 5% wrong temperature or a dropped token is > 1e-2.
GRAD_RTOL = 2**12 * U32
# The loss: a mean of the log-probs above over <= 48 tokens, each within LOGPROB_ATOL.
LOSS_ATOL = LOGPROB_ATOL

TEMPERATURE = 0.7
CHUNK = 4  # fused_linear_logprobs_chunk_size: several chunks per micro-batch
VOCAB, SEQ = 96, 16


# ---------------------------------------------------------------------------------- the trees


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=120)


def _blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Trees(NamedTuple):
    released: str
    patched: str


def _copy(src: Path, dst: Path) -> Path:
    # the whole tree but .git, bytecode and 3rdparty (submodules: empty in a checkout without them)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "3rdparty", "__pycache__", "*.pyc"))
    return dst


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> Trees:
    """The checkout as it is, and with the series applied (``git apply --check``, then
    ``git apply``, in order; a patch that does not apply cleanly fails here, with git's message)."""
    assert SERIES, "no patch in upstream/nemo-rl/"
    checkout = Path(os.environ[ENV]).expanduser().resolve()
    assert (checkout / "nemo_rl" / "__init__.py").is_file(), f"{ENV}={checkout}: no nemo_rl/ there"
    changed = [rel for rel, blob in BASE_BLOBS.items()
               if not (checkout / rel).is_file() or _blob(checkout / rel) != blob]
    assert not changed, f"{ENV}={checkout} is not NeMo RL at {COMMIT[:8]}: these files differ from it: {changed}"
    base = tmp_path_factory.mktemp("nemo-rl")
    released = _copy(checkout, base / "released")
    patched = _copy(checkout, base / "patched")
    # a repository of its own, so git apply takes the paths relative to the tree's root
    assert _git(["init", "-q"], patched).returncode == 0
    for patch in SERIES:  # each on the tree the ones before it made
        check = _git(["apply", "--check", "--whitespace=error", str(patch)], patched)
        assert check.returncode == 0, f"{patch.name} does not apply to {checkout}:\n{check.stderr}"
        applied = _git(["apply", "--whitespace=error", str(patch)], patched)
        assert applied.returncode == 0, f"{patch.name}:\n{applied.stderr}"
    return Trees(str(released), str(patched))


def test_the_series_applies_cleanly_and_each_patch_says_why(trees, tmp_path):
    """Applied in order by the fixture (``--check`` first, whitespace errors refused); here: the
    series is all the patched tree differs by (reversed, last first, it gives back the checkout,
    file for file), and each patch is a commit a maintainer can read: git format-patch's header, a
    conventional-commit subject, a why and a what."""
    back = tmp_path / "reversed"
    shutil.copytree(trees.patched, back, ignore=shutil.ignore_patterns(".git"))
    assert _git(["init", "-q"], back).returncode == 0
    for patch in reversed(SERIES):
        undo = _git(["apply", "--reverse", str(patch)], back)
        assert undo.returncode == 0, f"{patch.name} does not reverse:\n{undo.stderr}"
    released = Path(trees.released)

    def files(root: Path) -> set:
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}

    assert files(back) == files(released)
    changed = [f for f in files(released) if (back / f).read_bytes() != (released / f).read_bytes()]
    assert not changed, changed
    for patch in SERIES:
        header, _, diff = patch.read_text().partition("\n---\n")
        assert header.startswith("From ") and re.search(
            r"^Subject: \[PATCH \d+/\d+\] (build|feat|fix|refactor)(\([a-z]+\))?: \S", header, re.M
        ), patch.name
        assert re.search(r"^Why:", header, re.M) and re.search(r"^What:", header, re.M), patch.name
        assert "diff --git a/" in diff, patch.name


def _read(tree: str, rel: str) -> str:
    return (Path(tree) / rel).read_text()


def test_what_the_series_deletes_is_gone_and_was_there(trees):
    """Each concern's deletion and refusal, checked on both trees (so the check means something)."""
    gone = {
        "nemo_rl/distributed/model_utils.py": [
            "def patch_gpt_model_forward_for_linear_ce_fusion", "def _gpt_forward_with_linear_ce_fusion",
            "class ChunkedDistributedHiddenStatesToLogprobs", "def from_parallel_hidden_states_to_logprobs",
            "return_logprobs_for_linear_ce_fusion",
        ],
        "nemo_rl/models/megatron/train.py": ["return_logprobs_for_linear_ce_fusion", 'additional_kwargs["labels"]'],
        "nemo_rl/models/megatron/setup.py": [
            "patch_gpt_model_forward_for_linear_ce_fusion",
            "Context Parallelism is not supported with linear CE fusion loss",
            "use_fused_linear_logprobs is incompatible with overlap_param_gather",
        ],
        "nemo_rl/algorithms/grpo.py": ["Linear CE fusion loss is not supported with sequence packing"],
        "nemo_rl/algorithms/dpo.py": ["Linear CE fusion loss is not supported with sequence packing in DPO"],
    }
    for rel, needles in gone.items():
        for needle in needles:
            assert needle in _read(trees.released, rel), (rel, needle)
            assert needle not in _read(trees.patched, rel), (rel, needle)
    # what stays refused: top-k/top-p filtering with the fused path (GRPO), and the fused path on a
    # model that slices its CP inputs itself (Nemotron Omni)
    assert "not supported with top-k/top-p" in _read(trees.patched, "nemo_rl/algorithms/grpo.py")
    worker = "nemo_rl/models/policy/workers/megatron_policy_worker.py"
    assert '"use_fused_linear_logprobs=true."' in _read(trees.patched, worker)
    assert re.search(r'^\s*"mcore-hooks>=', _read(trees.patched, "pyproject.toml"), re.M)
    assert "mcore-hooks" not in _read(trees.released, "pyproject.toml")


def test_the_series_own_unit_tests_pass(trees):
    """The tests the series adds to NeMo RL's suite, run by pytest in the patched tree (NeMo RL's
    conftest, which starts a Ray cluster, left out; tests/nemo_rl_stubs.py loaded as a plugin)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), trees.patched]),
               PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "--noconftest",
         "-p", "nemo_rl_stubs", *SERIES_UNIT_TESTS],
        cwd=trees.patched, capture_output=True, text=True, env=env, timeout=600,
    )
    passed = f"{len(SERIES_UNIT_TESTS)} passed" in run.stdout
    assert run.returncode == 0 and passed, run.stdout[-3000:] + run.stderr[-2000:]


def _imports_at_import_time(tree: ast.Module, package: str) -> list:
    """The imports of ``package`` that run when the module is imported: module and class bodies,
    their ``if`` / ``try`` / ``with`` blocks, but not function bodies nor ``if TYPE_CHECKING:``."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == package or n.startswith(package + ".") for n in names):
            found.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_nemo_rl_imports_mcore_hooks_only_where_the_fused_path_runs(trees):
    """mcore-hooks is needed only with ``use_fused_linear_logprobs``: no file of the patched tree
    imports it when imported (an AST scan), and the fused path does import it, lazily."""
    root = Path(trees.patched)
    at_import, lazily = {}, []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        source = path.read_text()
        if "mcore_hooks" not in source:  # (and NeMo RL's Python 3.12 syntax need not parse on 3.11)
            continue
        with warnings.catch_warnings():  # NeMo RL's own invalid escapes (SyntaxWarning)
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, filename=rel)
        if lines := _imports_at_import_time(tree, "mcore_hooks"):
            at_import[rel] = lines
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "mcore_hooks" in ast.unparse(n)
               for n in ast.walk(tree)):
            lazily.append(rel)
    assert not at_import, f"imported at module level (file: lines): {at_import}"
    assert {"nemo_rl/models/megatron/setup.py", "nemo_rl/models/megatron/train.py"} <= set(lazily), lazily


def _calls(fn: ast.FunctionDef, name: str) -> list:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name]


def test_setup_gives_the_built_model_the_hook(trees):
    """setup_model_and_optimizer (not runnable without Megatron-Bridge): once the model chunks are
    built, ``enable_output_processor(model)`` when the fused path is on; no class patch before."""
    tree = ast.parse(_read(trees.patched, "nemo_rl/models/megatron/setup.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "setup_model_and_optimizer")
    (built,) = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and any(
        isinstance(c, ast.Call) and getattr(c.func, "id", None) == "get_model" for c in [n.value])]
    (enable,) = _calls(fn, "enable_output_processor")
    assert enable.lineno > built.lineno and [a.id for a in enable.args] == ["model"]
    guard = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and enable in list(ast.walk(n)))
    assert "use_fused_linear_logprobs" in ast.unparse(guard.test)
    released = ast.parse(_read(trees.released, "nemo_rl/models/megatron/setup.py"))
    fn = next(n for n in released.body if isinstance(n, ast.FunctionDef) and n.name == "setup_model_and_optimizer")
    assert _calls(fn, "patch_gpt_model_forward_for_linear_ce_fusion")


# ---------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tp: int = 1
    cp: int = 1
    sp: bool = False
    packed: bool = False
    fuse_loss: bool = False  # sequence_packing.fuse_loss: SequencePackingFusionLossWrapper
    tied: bool = False
    mtp: int = 0  # multi-token prediction depths
    lengths: tuple = (7, 16, 5)
    seed: int = 0


ONE_RANK = [
    Case("plain, untied"),
    Case("plain, tied", tied=True, seed=1),
    Case("packed THD", packed=True, seed=2),
    Case("packed THD, fused loss wrapper", packed=True, fuse_loss=True, tied=True, seed=3),
]
TP2 = [
    Case("TP 2", tp=2, seed=4),
    Case("TP 2 + SP", tp=2, sp=True, tied=True, seed=5),
    Case("TP 2 + SP, packed", tp=2, sp=True, packed=True, seed=6),
]
CP2 = [
    Case("CP 2, packed", cp=2, packed=True, seed=7),
    Case("CP 2, packed, fused loss wrapper", cp=2, packed=True, fuse_loss=True, tied=True, seed=8),
]


def _can_pack() -> bool:
    """NeMo RL 7ea279ab's packer builds ``PackedSeqParams(total_tokens=...)``: a field of the
    Megatron Core it builds (0.20) that older releases (0.16) lack."""
    import dataclasses as dc

    from megatron.core.packed_seq_params import PackedSeqParams

    return "total_tokens" in {f.name for f in dc.fields(PackedSeqParams)}


PACKING = pytest.mark.skipif(
    not _can_pack(), reason="NeMo RL 7ea279ab packs with PackedSeqParams(total_tokens=...), a field this "
    "megatron-core lacks (NeMo RL builds Megatron-LM 0.20)")


def _marks(case: Case) -> list:
    return [PACKING] if case.packed else []


def _params(cases: list) -> list:
    return [pytest.param(i, id=c.name, marks=_marks(c)) for i, c in enumerate(cases)]


MTP = [
    Case("MTP, 2 depths", mtp=2, seed=9),
    Case("MTP, 1 depth, packed", mtp=1, packed=True, tied=True, seed=10),
]


def _nemo_rl(tree: str) -> SimpleNamespace:
    """Import ``tree``'s NeMo RL (first on sys.path), with tests/nemo_rl_stubs.py installed: the
    modules under test themselves."""
    import importlib
    import sys

    import nemo_rl_stubs

    nemo_rl_stubs.install()
    if tree not in sys.path:
        sys.path.insert(0, tree)
    sys.dont_write_bytecode = True
    mods = {name: importlib.import_module(f"nemo_rl.{path}") for name, path in {
        "train": "models.megatron.train", "data": "models.megatron.data", "setup": "models.megatron.setup",
        "loss": "algorithms.loss.loss_functions", "sampling": "algorithms.logits_sampling_utils",
        "batched": "distributed.batched_data_dict", "model_utils": "distributed.model_utils",
    }.items()}
    assert mods["train"].__file__.startswith(tree), (mods["train"].__file__, tree)
    return SimpleNamespace(**mods)


def _tiny(case: Case, cp: int = 1):
    """A tiny stock GPTModel (same seed: same weights whatever the parallelism) without learned
    absolute positions: NeMo RL passes no position ids for packed batches (its models use RoPE),
    and the CPU attention takes its masks from the packing or the causal mask. On CP ranks:
    ``build_tiny_model``'s construction less its refusal of CP, with
    :class:`ContextParallelCoreAttention` in every layer."""
    cfg = TinyModelConfig(tied=case.tied, sequence_parallel=case.sp, vocab_size=VOCAB, mtp_num_layers=case.mtp)
    _inference_linears_without_te()
    if cp == 1:
        model = build_tiny_model(cfg)
    else:
        from megatron.core import parallel_state

        from mcore_hooks.testing import cpu_shims
        from mcore_hooks.testing import models as tiny

        with cpu_shims():
            tiny._ensure_rng_tracker_seeded(cfg.seed)
            model = tiny._construct(cfg, tiny.stock_model_class("gpt"), tiny._transformer_config(cfg, 1))
        model.config.context_parallel_size = cp  # as NeMo RL configures it (after the CPU attention's check)
        group = parallel_state.get_context_parallel_group()
        for layer in model.decoder.layers:
            attention = layer.self_attention
            attention.core_attention = ContextParallelCoreAttention(attention.core_attention, group)
    model.embedding.add_position_embedding = False
    return model.train()


def _inference_linears_without_te() -> None:
    """Megatron Core 0.20 (NeMo RL's) builds an MTP layer by asking
    ``isinstance(eh_proj, (InferenceColumnParallelLinear, ...))``; without Transformer Engine those
    names are MagicMock placeholders (subclasses of TE's), not classes, so the isinstance raises:
    here they are made classes nothing is an instance of, the answer a TE install gives for these
    CPU layers. Nothing to do on other releases (or where they are classes)."""
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:
        return
    for name in ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear"):
        if hasattr(inference_layers, name) and not isinstance(getattr(inference_layers, name), type):
            setattr(inference_layers, name, type(name, (), {}))


def _samples(case: Case) -> dict:
    """NeMo RL's micro-batch as its policy worker holds it: ``input_ids`` ``[B, S]`` (0 past each
    sample's length), ``input_lengths``, a ``token_mask`` with a few zeros (and zeros past the
    length), ``sample_mask``."""
    g = torch.Generator().manual_seed(case.seed)
    b = len(case.lengths)
    ids = torch.randint(1, VOCAB, (b, SEQ), generator=g)
    lengths = torch.tensor(case.lengths)
    inside = torch.arange(SEQ)[None, :] < lengths[:, None]
    ids = ids * inside
    token_mask = (torch.rand(b, SEQ, generator=g) > 0.15).float() * inside
    out = {"input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.ones(b)}
    if case.mtp:  # the policy worker's mtp_loss_mask: token_mask * sample_mask, unshifted
        out["mtp_loss_mask"] = token_mask * out["sample_mask"][:, None]
    return out


def _valid(case: Case) -> torch.Tensor:
    """``[B, S]``: the positions of the ``[B, S]`` log-probs that predict a real token (1..L-1)."""
    t = torch.arange(SEQ)[None, :]
    return (t >= 1) & (t < torch.tensor(case.lengths)[:, None])


def _megatron_cfg(case: Case) -> dict:
    return {"tensor_model_parallel_size": case.tp, "sequence_parallel": case.sp,
            "pipeline_model_parallel_size": 1, "context_parallel_size": case.cp}


def _policy_cfg(case: Case) -> dict:
    return {"sequence_packing": {"enabled": case.packed, "fuse_loss": case.fuse_loss},
            "logprob_chunk_size": None, "megatron_cfg": _megatron_cfg(case)}


def _microbatch(nr: SimpleNamespace, case: Case, samples: dict, cp: int):
    """``ProcessedMicrobatch`` as ``process_microbatch`` builds it on this rank: packed and
    CP-sharded by NeMo RL's own ``_pack_sequences_for_megatron`` with its own padding
    (``_get_pack_sequence_parameters_for_megatron``; ``make_sequence_length_divisible_by`` its
    minimum), or the plain batch with the causal mask (position ids: none, see :func:`_tiny`)."""
    from megatron.core import parallel_state

    data = nr.batched.BatchedDataDict(dict(samples))
    ids = samples["input_ids"]
    if not case.packed:
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(ids.shape[0], 1, SEQ, SEQ).clone()
        return nr.data.ProcessedMicrobatch(data_dict=data, input_ids=ids, input_ids_cp_sharded=ids,
                                           attention_mask=causal, position_ids=None,
                                           packed_seq_params=None, cu_seqlens_padded=None,
                                           mtp_loss_mask=samples.get("mtp_loss_mask"))
    divisible_by = (2 * cp if cp > 1 else 1) * (case.tp if case.sp else 1)
    pad_each, pad_pack, pad_to = nr.data._get_pack_sequence_parameters_for_megatron(
        _megatron_cfg(case), divisible_by, SEQ)

    def pack(x):
        return nr.data._pack_sequences_for_megatron(
            x, samples["input_lengths"], pad_each, pad_pack, pad_to,
            cp_rank=parallel_state.get_context_parallel_rank(), cp_size=cp)

    packed, local, params, _, cu_padded = pack(ids)
    mtp_mask = pack(samples["mtp_loss_mask"])[1] if case.mtp else None  # as process_microbatch packs it
    return nr.data.ProcessedMicrobatch(data_dict=data, input_ids=packed, input_ids_cp_sharded=local,
                                       attention_mask=None, position_ids=None, packed_seq_params=params,
                                       cu_seqlens_padded=cu_padded, mtp_loss_mask=mtp_mask)


def _grads(model) -> dict:
    """Every parameter's gradient, those of sequence-parallel parameters (the norms under SP, each
    rank's from its own tokens) all-reduced over the TP group as Megatron's
    ``finalize_model_grads`` does before the optimizer sees them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        out[n] = grad
    return out


def _run_nemo_rl(nr, case: Case, model, fused: bool, patched: bool) -> dict:
    """NeMo RL's train path on ``model``: get_logprobs' post-processing, then the loss and its
    backward (scaled by cp / num_microbatches, as Megatron's schedule scales it)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    samples = _samples(case)
    sampling = nr.sampling.TrainingSamplingParams(temperature=TEMPERATURE)
    extra = {"fused_linear_logprobs_chunk_size": CHUNK} if patched else {}
    mask = samples["token_mask"][:, 1:] * samples["sample_mask"][:, None]
    n_toks, n_seqs = mask.sum(), samples["sample_mask"].sum()

    def step(post):
        mb = _microbatch(nr, case, samples, cp)
        out, fn = nr.train.forward_with_post_processing_fn(
            iter([mb]), model, post, global_valid_seqs=n_seqs, global_valid_toks=n_toks,
            sampling_params=sampling, use_fused_linear_logprobs=fused, **extra)
        # the fused path returns the log-probs ([B, S-1], packed: [1, T-1]), not [b, s, V] logits
        assert out.dim() == (2 if fused else 3), out.shape
        return fn(out)

    model.eval()
    with torch.no_grad():
        _, metrics = step(nr.train.LogprobsPostProcessor(_policy_cfg(case), sampling, use_fused_linear_logprobs=fused))
    model.train()
    loss_fn = nr.loss.NLLLossFn(use_fused_linear_logprobs=fused)
    loss, _ = step(nr.train.LossPostProcessor(loss_fn, _policy_cfg(case), num_microbatches=1, sampling_params=sampling))
    loss = loss * cp  # Megatron's schedule: * cp_size / num_microbatches before the backward
    model.zero_grad()
    loss.backward()
    return {"logprobs": metrics["logprobs"].detach(), "loss": loss.item(), "grads": _grads(model)}


def _stock(case: Case) -> dict:
    """Stock Megatron on the unpacked batch: logits (gathered over TP) / T, log_softmax, the next
    token; NeMo RL's NLL (mask-weighted mean over the valid tokens) and its backward."""
    samples = _samples(case)
    ids = samples["input_ids"]
    model = _tiny(dataclasses.replace(case, cp=1))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(ids.shape[0], 1, SEQ, SEQ).clone()
    mtp = {"labels": None, "loss_mask": samples["mtp_loss_mask"]} if case.mtp else {}
    # gathered over TP (at TP 1 not asked for: the gather is then the identity, a view, which
    # Megatron's MTP cross-entropy would modify in place)
    gather = {"runtime_gather_output": True} if case.tp > 1 else {}
    logits = model(input_ids=ids, position_ids=None, attention_mask=causal, **gather, **mtp).float()
    logp = torch.log_softmax(logits[:, :-1] / TEMPERATURE, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = samples["token_mask"][:, 1:] * samples["sample_mask"][:, None]
    loss = -(logp * mask).sum() / mask.sum()
    model.zero_grad()
    loss.backward()
    logprobs = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)  # NeMo RL's [B, S] layout
    return {"logprobs": logprobs.detach(), "loss": loss.item(), "grads": _grads(model),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _rank(tree: str, patched: bool, cases: list, stock: bool, fused: Optional[bool] = None) -> dict:
    """On each rank: ``tree``'s NeMo RL train path for every case, fused in the patched tree
    (the model given the hook as the patched setup does), NeMo RL's logits path in the released
    one (``fused=True`` there: the released fused path, its class-wide forward patch applied before
    the model is built, as the released setup does); with ``stock``, stock Megatron too."""
    from megatron.core import parallel_state

    nr = _nemo_rl(tree)
    fused = patched if fused is None else fused
    if fused and not patched:
        nr.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=CHUNK)
    cp = parallel_state.get_context_parallel_world_size()
    out = {}
    for case in cases:
        model = _tiny(case, cp)
        if patched:
            from mcore_hooks import enable_output_processor

            enable_output_processor(model)
        res = _run_nemo_rl(nr, case, model, fused=fused, patched=patched)
        res["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if stock:
            res["stock"] = _stock(case)
        out[case.name] = res
    return out


# ---------------------------------------------------------------------------------- comparisons


def _close(what: str, got: torch.Tensor, ref: torch.Tensor, atol: float) -> float:
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    assert err <= atol, f"{what}: max |diff| {err:.3g} > {atol:.3g}"
    return err


def _close_grads(what: str, got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys() and got, (what, sorted(set(got) ^ set(ref)))
    worst = 0.0
    for name in ref:
        norm = ref[name].double().norm().item()
        rel = (got[name].double() - ref[name].double()).norm().item() / max(norm, 1e-30)
        assert rel <= GRAD_RTOL, f"{what}: {name} gradient off by {rel:.3g} (norm-wise) > {GRAD_RTOL:.3g}"
        worst = max(worst, rel)
    return worst


def _compare(case: Case, fused: dict, logits: dict, stock: dict, fused_grads: Optional[dict] = None) -> None:
    valid = _valid(case)
    for ref_name, ref in (("NeMo RL's logits path", logits), ("stock Megatron", stock)):
        what = f"{case.name}: fused vs {ref_name}"
        lp = _close(f"{what}, log-probs", fused["logprobs"][valid], ref["logprobs"][valid], LOGPROB_ATOL)
        assert abs(fused["loss"] - ref["loss"]) <= LOSS_ATOL, (what, fused["loss"], ref["loss"])
        g = _close_grads(f"{what}, gradients", fused_grads or fused["grads"], ref["grads"])
        # measured, for the record (pytest -s): in units of u = 2^-24
        print(f"{what}: log-probs {lp / U32:.0f} u, loss {abs(fused['loss'] - ref['loss']) / U32:.0f} u, "
              f"gradients {g / U32:.0f} u (norm-wise)")
    # the two references agree too (the comparison is not vacuous on either side)
    _close(f"{case.name}: logits path vs stock", logits["logprobs"][valid], stock["logprobs"][valid], LOGPROB_ATOL)


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.fixture(scope="module")
def one_rank(trees):
    cases = [c for c in ONE_RANK if not c.packed or _can_pack()]
    patched = run_on_ranks(_rank, 1, trees.patched, True, cases, False)[0]
    released = run_on_ranks(_rank, 1, trees.released, False, cases, True)[0]
    return patched, released


@pytest.mark.parametrize("index", _params(ONE_RANK))
def test_one_rank(one_rank, index):
    case = ONE_RANK[index]
    patched, released = one_rank[0][case.name], one_rank[1][case.name]
    _same_weights(patched["params"], released["params"])
    _compare(case, patched, released, released["stock"])


@pytest.mark.parametrize("index", _params(TP2))
def test_tensor_parallel_2(trees, index):
    """Every rank: its log-probs (whole, as NeMo RL gathers them) and its own shard of every
    gradient, against the logits path's and stock's on the same rank."""
    case = TP2[index]
    patched = run_on_ranks(_rank, 2, trees.patched, True, [case], False, tp=2)
    released = run_on_ranks(_rank, 2, trees.released, False, [case], True, tp=2)
    for p, r in zip(patched, released):
        _same_weights(p[case.name]["params"], r[case.name]["params"])
        _compare(case, p[case.name], r[case.name], r[case.name]["stock"])


@pytest.mark.parametrize("index", _params(CP2))
def test_context_parallel_2_with_packing(trees, index):
    """CP 2: every rank's log-probs are the whole batch's; the gradients, summed over the CP
    ranks, against the one-rank logits path and stock on the same packed batch."""
    case = CP2[index]
    patched = run_on_ranks(_rank, 2, trees.patched, True, [case], False, tp=1, cp=2)
    one = dataclasses.replace(case, cp=1)
    released = run_on_ranks(_rank, 1, trees.released, False, [one], True)[0][one.name]
    summed = {n: sum(rank[case.name]["grads"][n] for rank in patched) for n in patched[0][case.name]["grads"]}
    loss = sum(rank[case.name]["loss"] for rank in patched)
    for rank in patched:
        _same_weights(rank[case.name]["params"], released["params"])
        fused = dict(rank[case.name], loss=loss)
        _compare(case, fused, released, released["stock"], fused_grads=summed)


def _derives_mtp_labels() -> bool:
    from mcore_hooks import compat

    return compat.mtp_derives_labels()


@pytest.mark.skipif(not _derives_mtp_labels(), reason="NeMo RL calls the model with labels=None under MTP; "
                    "Megatron Core derives the depths' targets from input_ids from 0.19 (0.20 in NeMo RL)")
@pytest.mark.parametrize("index", _params(MTP))
def test_multi_token_prediction(trees, index):
    """MTP on, as NeMo RL's logits path runs it (labels=None, the MTP loss mask as loss_mask): the
    fused path now trains the MTP depths as that path does (their gradients equal; the depths' loss
    through the fused kernel); the released fused path (its class patch) skipped them."""
    case = MTP[index]
    patched = run_on_ranks(_rank, 1, trees.patched, True, [case], False)[0][case.name]
    released = run_on_ranks(_rank, 1, trees.released, False, [case], True)[0][case.name]
    for grads in (released["grads"], released["stock"]["grads"]):
        assert any(n.startswith("mtp.") for n in grads)
    _same_weights(patched["params"], released["params"])
    _compare(case, patched, released, released["stock"])
    old = run_on_ranks(_rank, 1, trees.released, False, [case], False, True)[0][case.name]
    assert not any(n.startswith("mtp.") for n in old["grads"]), "the released fused path trained the MTP depths"


def _temperature_is_one_float(tree: str) -> bool:
    nr = _nemo_rl(tree)
    field = {f.name: f for f in dataclasses.fields(nr.sampling.TrainingSamplingParams)}["temperature"]
    return field.type in (float, "float")


def test_nemo_rl_has_one_temperature_per_run(trees):
    """No per-sample temperature case: NeMo RL's TrainingSamplingParams holds one float (were it a
    tensor, this fails, and a per-sample case belongs here: NemoRLLogprobProcessor takes one)."""
    assert run_on_ranks(_temperature_is_one_float, 1, trees.patched)[0]


# ---------------------------------------------------------------------------------- negative control


def _released_fused(tree: str, temperature: float) -> dict:
    """The released fused path: the class-wide forward patch, then NeMo RL's own fused call
    (``return_logprobs_for_linear_ce_fusion``), its log-probs divided by the temperature after."""
    nr = _nemo_rl(tree)
    nr.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=CHUNK)
    case = ONE_RANK[0]
    samples = _samples(case)
    sampling = nr.sampling.TrainingSamplingParams(temperature=temperature)
    model = _tiny(case).eval()
    post = nr.train.LogprobsPostProcessor(_policy_cfg(case), sampling, use_fused_linear_logprobs=True)
    with torch.no_grad():
        out, fn = nr.train.forward_with_post_processing_fn(
            iter([_microbatch(nr, case, samples, 1)]), model, post, sampling_params=sampling,
            use_fused_linear_logprobs=True)
        return fn(out)[1]["logprobs"]


def _patched_fused(tree: str, temperature: float) -> torch.Tensor:
    from mcore_hooks import enable_output_processor

    nr = _nemo_rl(tree)
    case = ONE_RANK[0]
    sampling = nr.sampling.TrainingSamplingParams(temperature=temperature)
    model = enable_output_processor(_tiny(case).eval())
    post = nr.train.LogprobsPostProcessor(_policy_cfg(case), sampling, use_fused_linear_logprobs=True)
    with torch.no_grad():
        out, fn = nr.train.forward_with_post_processing_fn(
            iter([_microbatch(nr, case, _samples(case), 1)]), model, post, sampling_params=sampling,
            use_fused_linear_logprobs=True, fused_linear_logprobs_chunk_size=CHUNK)
        return fn(out)[1]["logprobs"]


def test_the_released_fused_path_divided_the_log_probs(trees, one_rank):
    """Negative control: the released fused path at T = 0.7 gives log_softmax(z) / T, far from the
    log-probs at the temperature (both NeMo RL's logits path and the patched fused path); at T = 1,
    where the two agree by definition, it equals the patched path."""
    case = ONE_RANK[0]
    valid = _valid(case)
    logits = one_rank[1][case.name]["logprobs"][valid]
    old = run_on_ranks(_released_fused, 1, trees.released, TEMPERATURE)[0][valid]
    rel = ((old - logits).norm() / logits.norm()).item()
    assert rel > 0.1, f"the released fused path should differ at T={TEMPERATURE}: {rel:.3g}"
    old1 = run_on_ranks(_released_fused, 1, trees.released, 1.0)[0]
    new1 = run_on_ranks(_patched_fused, 1, trees.patched, 1.0)[0]
    _close("released vs patched fused path at T = 1", new1[valid], old1[valid], LOGPROB_ATOL)


# ---------------------------------------------------------------------------------- overlap_param_gather


def _stale_weight_run(tree: str, patched: bool) -> dict:
    """What ``overlap_param_gather`` needs of the fused path: Megatron's distributed optimizer
    all-gathers each parameter bucket asynchronously and waits for it in a forward pre-hook of the
    module that owns it. Here the output layer's weight starts stale (zeros) and a pre-hook on the
    output layer puts the gathered value in (that wait, standing in); the fused log-probs must be
    those of the gathered weight. Untied output weight (a tied one is the embedding's, gathered
    before the decoder runs)."""
    nr = _nemo_rl(tree)
    case = ONE_RANK[0]
    if not patched:
        nr.model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=CHUNK)
    sampling = nr.sampling.TrainingSamplingParams(temperature=1.0)
    model = _tiny(case).eval()
    if patched:
        from mcore_hooks import enable_output_processor

        enable_output_processor(model)
    layer = model.output_layer
    gathered = layer.weight.detach().clone()
    calls = []

    def wait_for_all_gather(module, args):
        calls.append(1)
        with torch.no_grad():
            module.weight.copy_(gathered)

    with torch.no_grad():
        layer.weight.zero_()
    handle = layer.register_forward_pre_hook(wait_for_all_gather)
    post = nr.train.LogprobsPostProcessor(_policy_cfg(case), sampling, use_fused_linear_logprobs=True)
    extra = {"fused_linear_logprobs_chunk_size": CHUNK} if patched else {}
    with torch.no_grad():
        out, fn = nr.train.forward_with_post_processing_fn(
            iter([_microbatch(nr, case, _samples(case), 1)]), model, post, sampling_params=sampling,
            use_fused_linear_logprobs=True, **extra)
        logprobs = fn(out)[1]["logprobs"]
    handle.remove()
    return {"logprobs": logprobs, "hook_calls": len(calls)}


def _stock_at_one(tree: str) -> torch.Tensor:
    case = ONE_RANK[0]
    samples = _samples(case)
    ids = samples["input_ids"]
    model = _tiny(case).eval()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(ids.shape[0], 1, SEQ, SEQ).clone()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=None, attention_mask=causal).float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def test_the_fused_path_waits_for_the_output_weight(trees):
    """Why overlap_param_gather's refusal can go: the patched fused path runs the output layer's
    forward pre-hooks (once) before reading its weight, so it computes with the gathered weight;
    the released one read the weight without them (the stale zeros: uniform log-probs)."""
    case = ONE_RANK[0]
    valid = _valid(case)
    ref = run_on_ranks(_stock_at_one, 1, trees.released)[0]
    new = run_on_ranks(_stale_weight_run, 1, trees.patched, True)[0]
    assert new["hook_calls"] == 1
    _close("patched fused path after the all-gather wait", new["logprobs"][valid], ref[valid], LOGPROB_ATOL)
    old = run_on_ranks(_stale_weight_run, 1, trees.released, False)[0]
    assert old["hook_calls"] == 0
    uniform = torch.full_like(ref[valid], -torch.log(torch.tensor(float(VOCAB))).item())
    _close("released fused path: the stale weight", old["logprobs"][valid], uniform, LOGPROB_ATOL)


# ---------------------------------------------------------------------------------- setup's refusals


def _setup_checks(tree: str) -> dict:
    """setup.py's two checks that involve the fused path, called as setup calls them."""
    nr = _nemo_rl(tree)
    cfg = {
        "sequence_packing": {"enabled": True},
        "train_global_batch_size": 8,
        "megatron_cfg": {
            "use_fused_linear_logprobs": True, "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1, "num_layers_in_first_pipeline_stage": None,
            "num_layers_in_last_pipeline_stage": None, "sequence_parallel": False,
            "context_parallel_size": 2, "fp8_cfg": None, "train_iters": 1, "scheduler": {},
            "optimizer": {"use_distributed_optimizer": True},
            "distributed_data_parallel_config": {
                "overlap_param_gather": True, "grad_reduce_in_fp32": False,
                "overlap_grad_reduce": True, "data_parallel_sharding_strategy": "optim_grads_params",
            },
        },
    }
    out = {}
    for name, call in {
        "context parallelism": lambda: nr.setup._apply_parallelism_config(SimpleNamespace(), cfg),
        "overlap_param_gather": lambda: nr.setup._create_megatron_config(
            SimpleNamespace(), None, cfg, "tiny", torch.float32),
    }.items():
        try:
            call()
            out[name] = None
        except AssertionError as e:
            out[name] = str(e)
    return out


def test_setup_no_longer_refuses_cp_or_overlap_param_gather_with_the_fused_path(trees):
    released = run_on_ranks(_setup_checks, 1, trees.released)[0]
    patched = run_on_ranks(_setup_checks, 1, trees.patched)[0]
    assert "linear CE fusion" in (released["context parallelism"] or "")
    assert "overlap_param_gather" in (released["overlap_param_gather"] or "")
    assert patched == {"context parallelism": None, "overlap_param_gather": None}
