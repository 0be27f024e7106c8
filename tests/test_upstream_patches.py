"""The patches in ``upstream/`` (against Megatron Core 0.19.2): each applies to a copy of the
installed package, and the equivalence suite passes against the patched native hooks.

With 0001, HybridModel (and MambaModel, its subclass) has upstream's ``output_processor`` hook, so
the hook tests compare our backport with it keyword for keyword (``test_hook.py``'s
``test_backport_and_native_deliver_the_same_keywords`` then covers it); with 0002,
``process_mtp_loss`` calls the processor's ``mtp_loss_fn`` itself, so the MTP tests run the
bundled processors' MTP loss with no stand-ins. Runs where the installed release is 0.19.2.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "upstream").glob("*.patch"))

pytestmark = pytest.mark.skipif(
    importlib.metadata.version("megatron-core") != "0.19.2",
    reason="the upstream patches are against Megatron Core 0.19.2",
)


def _apply(patch: Path, root: Path) -> None:
    """``git apply`` (which works outside a repository), else ``patch -p1``."""
    if shutil.which("git"):
        cmd = ["git", "apply", "--whitespace=nowarn", str(patch)]
    else:
        cmd = ["patch", "-p1", "--forward", "-i", str(patch)]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, f"{patch.name} does not apply:\n{run.stdout}{run.stderr}"


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """A copy of the installed ``megatron`` package with every patch applied, in order."""
    source = Path(importlib.util.find_spec("megatron").submodule_search_locations[0])
    root = tmp_path_factory.mktemp("patched-megatron")
    shutil.copytree(source, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    assert [p.name for p in PATCHES] == [
        "0001-hybridmodel-output-processor.patch", "0002-process-mtp-loss-callable.patch",
    ]
    for patch in PATCHES:
        _apply(patch, root)
    return root


def _run(args: list[str], root: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


PROBE = """
import json, megatron.core
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.models.gpt.gpt_model import GPTModel
from mcore_hooks import compat
print(json.dumps(dict(
    megatron=megatron.core.__file__, hybrid_native=compat.has_native_hook(HybridModel),
    gpt_native=compat.has_native_hook(GPTModel), mtp_loss_fn=compat.native_mtp_loss_fn(),
)))
"""


def test_the_patched_release_has_the_native_hooks(patched):
    run = _run(["-c", PROBE], patched)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["megatron"].startswith(str(patched))
    assert probe == dict(probe, hybrid_native=True, gpt_native=True, mtp_loss_fn=True)


def test_equivalence_suite_against_the_patched_native_hooks(patched):
    suite = ["tests/test_hook.py", "tests/test_processors.py", "tests/test_mtp.py", "tests/test_schedule_plan.py"]
    run = _run(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *suite], patched)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    verify = _run(["-m", "mcore_hooks", "verify", "--tp", "1"], patched)
    assert verify.returncode == 0, verify.stdout[-6000:] + verify.stderr[-3000:]
    assert "failed" in verify.stdout and " 0 failed" in verify.stdout
