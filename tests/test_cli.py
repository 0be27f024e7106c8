"""The command line as a new user meets it: help, a clean report, a pipe closed early."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

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


def test_verify_reports_the_verdict_first_and_the_table_on_request():
    """The verdict on the second line (then only failing rows), not at the end of 400 rows; the
    whole table with --table; no notes Megatron prints about a machine without CUDA."""
    out = subprocess.run(CLI + QUICK, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    version = importlib.metadata.version("megatron-core")
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"mcore-hooks verify: Megatron Core {version}, torch ")
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[1]) and len(lines) == 4, out.stdout
    assert lines[2].startswith("covered: gpt at TP 1, float32 and bf16") and "through the hook" in lines[2]
    notes = re.compile("|".join(KNOWN_NOTES))
    assert not [line for line in out.stderr.splitlines() if notes.search(line)], out.stderr
    table = subprocess.run(CLI + QUICK + ["--table"], capture_output=True, text=True, timeout=300)
    assert table.returncode == 0 and "processor" in table.stdout and len(table.stdout.splitlines()) > 20


def test_version_and_the_commands_own_usage_in_its_errors():
    from mcore_hooks import __version__

    out = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=60)
    version = importlib.metadata.version("megatron-core")
    assert out.returncode == 0 and out.stdout.strip() == f"mcore-hooks {__version__} (Megatron Core {version})"
    for args, says in ((["verify", "--tp", "0"], "--tp: expected positive integers"),
                       (["verify", "--bogus"], "unrecognized arguments: --bogus")):
        bad = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("usage: mcore-hooks verify ") and says in bad.stderr


def test_a_closed_pipe_ends_quietly_with_the_checks_status():
    proc = subprocess.Popen(CLI + QUICK + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head -0`: nobody reads the report
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()


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
