import warnings

import pytest

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl).*")


@pytest.fixture(scope="session")
def mp1():
    """Megatron's model-parallel state for one rank, in this process (no spawn)."""
    from mcore_hooks.testing import model_parallel

    with model_parallel(tp=1):
        yield
