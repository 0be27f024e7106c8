import os
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help="the whole suite: also the tests marked slow (CI runs it; the default is a few minutes on 2 cores)",
    )


def pytest_collection_modifyitems(config, items):
    """``pytest`` alone (the tests folder) leaves out the tests marked ``slow``; ``--full``, a
    ``-m`` expression that names ``slow``, ``-k``, or files / tests named on the command line run
    what they select, slow or not."""
    if config.getoption("--full") or "slow" in (config.option.markexpr or "") or config.option.keyword:
        return
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config._mcore_hooks_slow = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_mcore_hooks_slow", 0)
    if n:
        terminalreporter.write_line(f"{n} slow tests deselected: `pytest --full` runs them too")


def pytest_configure(config):
    # Megatron Core's notes about itself on a CPU machine (missing TE/Apex, deprecated classes),
    # by message; every other warning still shows in the summary.
    for pattern in KNOWN_NOTES:
        config.addinivalue_line("filterwarnings", f"ignore:{pattern}")

# Without a GPU, Triton kernels run under Triton's interpreter (read when kernels are defined, so
# set before anything imports them; spawned ranks inherit it).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

from mcore_hooks._quiet import KNOWN_NOTES  # noqa: E402  (after the interpreter switch)


# CI replays the same property-test examples every run (a failure there is reproducible, never a
# new random draw); local runs keep exploring. Reproduce a local failure with --hypothesis-seed.
try:
    import tempfile

    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir

    # its caches (the constants it draws from the code) in the temporary directory, not the
    # clone; one per Python (CI runs its two lines side by side, each its own hypothesis)
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(),
                                         f"mcore-hooks-hypothesis-py{sys.version_info[0]}{sys.version_info[1]}"))

    # No example database: a run leaves no .hypothesis/ in the clone; a failure prints the blob
    # that replays it (@reproduce_failure).
    settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
    # Local runs draw new examples.
    settings.register_profile("local", print_blob=True, database=None)
    settings.load_profile("ci" if os.environ.get("CI") else "local")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def mp1():
    """Megatron's model-parallel state for one rank, in this process (no spawn)."""
    from mcore_hooks.testing import model_parallel

    with model_parallel(tp=1):
        yield
