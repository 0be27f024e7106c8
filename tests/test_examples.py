import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_grpo_example_gives_the_same_update_both_ways():
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_step.py")],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "same losses and same updated weights" in run.stdout
