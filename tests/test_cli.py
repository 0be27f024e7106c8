"""The command line as a new user meets it: help, a clean report, a pipe closed early."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pytest

from mcore_hooks._quiet import KNOWN_NOTES

CLI = [sys.executable, "-m", "mcore_hooks"]
QUICK = ["verify", "--tp", "1", "--model", "gpt"]


def test_help_says_what_the_tool_does():
    out = subprocess.run(CLI + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "output_processor" in out.stdout and "verify" in out.stdout
    assert "at least as accurate as stock" in out.stdout
    sub = subprocess.run(CLI + ["verify", "--help"], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0 and "--device" in sub.stdout and "--tp" in sub.stdout
    bad = subprocess.run(CLI + ["check"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'check'" in bad.stderr


def test_help_lists_each_command_once():
    """Each subcommand on one line of the help's "commands:" section, and nowhere else as a
    listing (argparse's default adds the subparsers' metavar, ``verify``, as a line above it)."""
    import argparse

    from mcore_hooks.cli import _parser

    subparsers = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    names = [n for a in subparsers for n in a.choices]
    assert names == ["verify"]
    out = subprocess.run(CLI + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    listing = out.stdout.split("\ncommands:\n", 1)[1].splitlines()
    usage = out.stdout.splitlines()[0]
    for name in names:
        assert [line.split()[0] for line in listing if line.strip()].count(name) == 1, out.stdout
        listed = [line for line in out.stdout.splitlines() if re.match(rf"\s+\{{?{name}\}}?(\s|$)", line)]
        assert len(listed) == 1, listed
        assert usage.count(name) == 0, usage  # "usage: mcore-hooks [-h] [--version] command ..."


@pytest.mark.slow
def test_verify_reports_the_verdict_first_and_the_table_on_request():
    """The verdict on the second line (then only failing rows), not at the end of 400 rows; the
    whole table with --table; no notes Megatron prints about a machine without CUDA."""
    out = subprocess.run(CLI + QUICK, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    version = importlib.metadata.version("megatron-core")
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"mcore-hooks verify: Megatron Core {version}, torch ")
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[1]) and len(lines) == 5, out.stdout
    assert lines[2].startswith("covered: gpt at TP 1, float32 and bf16") and "through the hook" in lines[2]
    assert lines[3].startswith("processors checked (")
    notes = re.compile("|".join(KNOWN_NOTES))
    assert not [line for line in out.stderr.splitlines() if notes.search(line)], out.stderr
    table = subprocess.run(CLI + QUICK + ["--table"], capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and "processor" in table.stdout and len(table.stdout.splitlines()) > 20


def _public_processors() -> list[str]:
    """Every processor a user can import: the package's exports (``mcore_hooks.__all__``) and
    the integrations', by class; a new one without a verify check fails the test below."""
    import mcore_hooks
    import mcore_hooks.integrations
    from mcore_hooks import PostprocessProcessor

    found = [getattr(mcore_hooks, n) for n in mcore_hooks.__all__]
    found += [getattr(mcore_hooks.integrations, n) for n in mcore_hooks.integrations.__all__]
    return [c.__name__ for c in found if isinstance(c, type) and issubclass(c, PostprocessProcessor)
            and c is not PostprocessProcessor]


def test_verify_names_every_public_processor_and_reports_progress():
    """The report names every processor it checked, and every public processor is among them;
    stderr says how it goes, one flushed line per class and group with its counts (stdout keeps
    the report alone: --json stays JSON)."""
    public = _public_processors()
    assert {"SelectedLogprobProcessor", "TopKDistillationProcessor", "VerlFusedProcessor",
            "NemoRLLogprobProcessor"} <= set(public)
    out = subprocess.run(CLI + QUICK, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    checked = [line for line in out.stdout.splitlines() if line.startswith("processors checked (")]
    assert len(checked) == 1, out.stdout
    # "A, B (gpt only), ...; why": the names without what follows them
    names = [n.split(" (")[0] for n in checked[0].split(": ", 1)[1].split("; ")[0].split(", ")]
    assert checked[0].startswith(f"processors checked ({len(names)}): ")
    missing = [n for n in public if n not in names]
    assert not missing, f"public processors verify does not check: {missing}"
    progress = [line for line in out.stderr.splitlines() if line.startswith("mcore-hooks verify: ")]
    assert progress[0].startswith(f"mcore-hooks verify: {len(names)} processors on gpt at TP 1"), out.stderr
    groups = [re.fullmatch(r"mcore-hooks verify: gpt tp1 (float32 vs stock|bf16 vs float64): (\d+) checks "
                           r"\((\d+) processors, 4 layouts\), (\d+) passed, 0 failed, [\d.]+ s", line)
              for line in progress[1:]]
    assert len(groups) == 2 and all(groups), out.stderr
    assert [g[1] for g in groups] == ["float32 vs stock", "bf16 vs float64"]
    assert int(groups[0][3]) == len(names)  # every processor has a float32 check against stock
    assert sum(int(g[4]) for g in groups) == int(out.stdout.splitlines()[1].split()[0])
    as_json = subprocess.run(CLI + QUICK + ["--json"], capture_output=True, text=True, timeout=300)
    assert json.loads(as_json.stdout)["processors"] == names


def test_version_and_the_commands_own_usage_in_its_errors():
    from mcore_hooks import __version__

    out = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=60)
    version = importlib.metadata.version("megatron-core")
    assert out.returncode == 0 and out.stdout.strip() == f"mcore-hooks {__version__} (Megatron Core {version})"
    for args, says in ((["verify", "--tp", "0"], "--tp: expected positive integers"),
                       (["verify", "--bogus"], "unrecognized arguments: --bogus")):
        bad = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("usage: mcore-hooks verify ") and says in bad.stderr


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly_with_the_checks_status():
    proc = subprocess.Popen(CLI + QUICK + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head -0`: nobody reads the report
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()


@pytest.mark.slow
def test_usage_errors_are_one_line_and_exit_2():
    """A tensor-parallel size the tiny models cannot split over, or a class the release lacks:
    a one-line usage error (exit 2), never a traceback or a 'mismatch' exit 1."""
    out = subprocess.run(CLI + ["verify", "--tp", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--tp 3: the tiny models' 4 attention heads" in out.stderr.splitlines()[-1]
    from mcore_hooks.testing import available_model_classes

    if "hybrid" not in available_model_classes():
        out = subprocess.run(CLI + ["verify", "--model", "hybrid"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "HybridModel arrived in Megatron Core 0.18" in out.stderr
