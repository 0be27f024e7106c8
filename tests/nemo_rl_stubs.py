"""What NeMo RL's Megatron modules (at 7ea279ab) import on a CPU machine that cannot be had there,
for ``tests/test_nemo_rl_series.py``; nothing here computes anything the tests compare.

:func:`install` puts them in place, in the process that calls it: the test calls it only in its
rank processes (``run_on_ranks``: fresh processes), never in the pytest process, so no other
test sees a stub. Each stand-in's docstring (:data:`ABSENT`, :data:`FALLBACK`,
:data:`ATTRIBUTES`) says what it stands in for and why the real thing is not used.

Everything else those modules import is the real package: see :data:`REQUIRED` and
:func:`check_requirements`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

#: The PyPI packages NeMo RL's Megatron modules (``nemo_rl.models.megatron.{train,setup,data}``,
#: ``nemo_rl.algorithms.{loss,grpo,dpo}``) import on a CPU machine, beside torch, megatron-core
#: and mcore-hooks (import name: pip requirement). transformers: NeMo RL pins >=5.5.0,<5.9.0; its
#: modules import with any release below 5.12 (above it, its deepseek_v3 tokenizer patch asserts).
REQUIRED = {
    "transformers": "transformers>=5.5.0,<5.12",
    "pydantic": "pydantic",
    "requests": "requests",
    "PIL": "pillow",
    "zmq": "pyzmq",
    "pynvml": "nvidia-ml-py",
    "uvicorn": "uvicorn",
    "fastapi": "fastapi",
    "prometheus_client": "prometheus_client",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "rich": "rich",
}


def check_requirements() -> None:
    """Raise ImportError naming every missing package and the pip line that installs them."""
    missing = [req for name, req in REQUIRED.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            "NeMo RL's Megatron modules need these packages, missing here: "
            + ", ".join(missing)
            + "\ninstall them with: pip install "
            + " ".join(f"'{m}'" for m in missing)
        )


#: Always stood in for (module prefix: what it stands in for, and why not the real one).
ABSENT = {
    "ray": "Ray, NeMo RL's cluster runtime (actors, placement groups, remote calls), imported at "
    "module level across nemo_rl (virtual_cluster, the generation workers, the logger). The "
    "code under test (model forward, post-processors, loss wrappers, setup's checks) calls none "
    "of it; Ray's wheel would install but is a few hundred MB and starts processes of its own. "
    "ray.remote, as Ray's, returns an object that is not the decorated function "
    "(RemoteStandIn), so that pytest does not collect a test left under it.",
    "megatron.bridge": "Megatron-Bridge (NeMo RL's model provider, get_model, training config "
    "containers, checkpointing; a submodule at 8c46dc42). It needs Megatron-LM 0.20 "
    "(megatron-core[dev,mlm]), transformers >= 5.8, flashinfer and Transformer Engine, which do "
    "not install next to megatron-core 0.16 / 0.19 on a CPU machine. The tests build their "
    "models themselves; setup.py's config containers are then opaque objects here.",
    "mlflow": "MLflow, an experiment tracker nemo_rl.utils.logger imports at module level; "
    "nothing under test logs (MLflow pulls in a web server and a database layer).",
    "swanlab": "SwanLab, an experiment tracker nemo_rl.utils.logger imports at module level; "
    "nothing under test logs.",
    "wandb": "Weights & Biases, an experiment tracker nemo_rl.utils.logger imports at module "
    "level; nothing under test logs.",
    "matplotlib": "matplotlib, which nemo_rl.utils.logger imports for its plots; nothing under "
    "test plots.",
    "torch.utils.tensorboard": "torch's TensorBoard writer (needs the tensorboard package), which "
    "nemo_rl.utils.logger imports at module level; nothing under test logs.",
}

#: Stood in for only where the installed Megatron Core lacks them: modules of Megatron-LM 0.20
#: (the release NeMo RL 7ea279ab builds) that megatron-core 0.16 / 0.19 do not have.
FALLBACK = {
    "megatron.core.inference.shards": "megatron.core.inference.shards (Megatron-LM 0.20), which "
    "nemo_rl.models.megatron.setup imports for its colocated-inference process groups; not "
    "called by the tests.",
    "megatron.core.transformer.moe.moe_logging": "megatron.core.transformer.moe.moe_logging "
    "(Megatron-LM 0.20), which nemo_rl.models.megatron.common imports for MoE metrics; the "
    "tests' models have no MoE layers.",
}

#: Names added to an existing Megatron Core module where the installed release lacks them.
ATTRIBUTES = {
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"): "the inference CUDA-graph "
    "scope enum (Megatron Core 0.17+), which nemo_rl.models.megatron.setup imports for its "
    "inference config; not used by the tests.",
}


class _AbsentMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a bare decorator: the decorated object, unchanged
        return super().__call__(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class Absent(metaclass=_AbsentMeta):
    """Any name of a stood-in module (see the module's own docstring for what it stands in
    for): a class (so it can be subclassed and used in annotations) whose attributes are Absent,
    whose instances' attributes and calls are Absent, and which, called on a single callable (a
    decorator, bare or after its arguments), returns that callable unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return Absent()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent()


class RemoteStandIn:
    """What the stand-in ``ray.remote`` makes of a function or class: as Ray's own
    ``RemoteFunction`` / ``ActorClass``, an object that is not the function or class it was given,
    so that a test function left under ``@ray.remote`` by mistake is not collected by pytest (not a
    function) and calling one directly raises Ray's TypeError. ``.remote()`` gives an
    :class:`Absent`, ``.options()`` the same stand-in."""

    def __init__(self, target: Any) -> None:
        self._target = target  # never __wrapped__: pytest would unwrap it to the function

    def __repr__(self) -> str:
        return f"<ray.remote stand-in for {getattr(self._target, '__qualname__', self._target)!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self._target, "__name__", "it")
        raise TypeError(
            f"Remote functions cannot be called directly. Instead of running '{name}()', try "
            f"'{name}.remote()' (Ray's message; here: the stand-in of tests/nemo_rl_stubs.py)"
        )

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return Absent()

    def options(self, *args: Any, **kwargs: Any) -> "RemoteStandIn":
        return self


def _ray_remote(*args: Any, **kwargs: Any) -> Any:
    """``ray.remote``, bare (``@ray.remote``) or with options (``@ray.remote(num_gpus=1)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return RemoteStandIn(args[0])
    return RemoteStandIn


#: Names of a stood-in module that are not :class:`Absent` ((module, name): value).
SPECIAL = {("ray", "remote"): _ray_remote}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports every module under ``prefixes`` as a stand-in whose docstring is its entry."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def _entry(self, name: str) -> Any:
        for prefix, doc in self.table.items():
            if name == prefix or name.startswith(prefix + "."):
                return doc
        return None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if self._entry(name) is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name, f"Stand-in (tests/nemo_rl_stubs.py) for {self._entry(spec.name)}")
        module.__path__ = []
        for (module_name, attr), value in SPECIAL.items():
            if module_name == spec.name:
                setattr(module, attr, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Put the stand-ins in place in this process: :data:`ABSENT` before every other finder,
    :data:`FALLBACK` after them (used only where the real module is not found), and
    :data:`ATTRIBUTES` on their modules where missing. Idempotent."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    check_requirements()
    sys.meta_path.insert(0, _Finder(ABSENT))
    sys.meta_path.append(_Finder(FALLBACK))
    for (module_name, attr), doc in ATTRIBUTES.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            stand_in = type(attr, (Absent,), {"__doc__": f"Stand-in (tests/nemo_rl_stubs.py) for {doc}"})
            setattr(module, attr, stand_in)


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (``-p nemo_rl_stubs``, for NeMo RL's own unit tests run in a subprocess
    of the series test): install the stand-ins before any test module is imported."""
    install()
