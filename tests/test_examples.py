"""The examples run and agree with the stock path (each prints its verdict and exits 1 if not)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "example, verdict",
    [
        ("grpo_step.py", "equal within those tolerances"),
        ("verl_style_step.py", "same as the stock path"),
        ("nemo_rl_style_step.py", "same as the stock path"),
    ],
)
def test_example_agrees_with_the_stock_path(example, verdict):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert verdict in run.stdout
    assert "UserWarning" not in run.stderr, run.stderr  # Megatron's notes are silenced by message
