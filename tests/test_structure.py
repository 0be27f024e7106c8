"""The package's import structure, read from its source (nothing is imported): the layers of
``mcore_hooks/__init__.py``'s docstring hold.

* no cycle among the package's modules, counting imports inside functions too (so none can hide
  one);
* ``mcore_hooks.kernels`` imports torch, triton and the standard library only: never Megatron
  Core, never the rest of the package;
* ``mcore_hooks.kernels``' sub-packages import one way (entry points, kept sets, passes,
  backends, common), and each says in its docstring what it holds;
* no folder of the package holds more than 15 modules;
* ``mcore_hooks.compat`` imports no module of this package;
* only ``mcore_hooks.hooked`` imports ``postprocess``, ``mtp`` and ``schedule_plan`` together.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

PACKAGE = "mcore_hooks"
# the package Python would import (the source tree, or an installed wheel), found without importing it
ROOT = pathlib.Path(importlib.util.find_spec(PACKAGE).origin).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports (absolute names), at any depth of its code."""
    tree = ast.parse(MODULES[name].read_text())
    here = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= submodules  # `from . import compat` imports the submodule
            if len(submodules) < len(node.names):  # and names of the module itself
                out.add(module)
    return out


def _internal(name: str) -> set[str]:
    return {m for m in _imports(name) if m in MODULES and m != name}


def _external(name: str) -> set[str]:
    return {m.split(".")[0] for m in _imports(name) if not m.startswith(PACKAGE)}


def test_no_import_cycle():
    graph = {m: _internal(m) for m in MODULES}
    # Tarjan's strongly connected components: any of size > 1 is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_kernels_import_torch_and_triton_only():
    allowed = set(sys.stdlib_module_names) | {"torch", "triton", "__future__"}
    for name in MODULES:
        if name == f"{PACKAGE}.kernels" or name.startswith(f"{PACKAGE}.kernels."):
            outside = {m for m in _internal(name) if not m.startswith(f"{PACKAGE}.kernels")}
            assert not outside, f"{name} imports {outside} (kernels may import only kernels)"
            assert _external(name) <= allowed, f"{name} imports {_external(name) - allowed}"


# mcore_hooks.kernels' sub-packages, each importing only those after it (the entry points,
# mcore_hooks.kernels itself, import any); the two backends are side by side
KERNEL_LAYERS = [{"kept_sets"}, {"passes"}, {"torch_backend", "triton_backend"}, {"common"}]


def _kernels_part(name: str) -> str:
    """The sub-package of ``mcore_hooks.kernels`` that module ``name`` is in ("" for the package)."""
    rest = name[len(f"{PACKAGE}.kernels"):].lstrip(".")
    return rest.split(".")[0]


def test_kernels_subpackages_import_one_way():
    parts = {p.name for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").exists()}
    assert parts == set().union(*KERNEL_LAYERS), parts
    assert not [p.name for p in (ROOT / "kernels").glob("*.py") if p.name != "__init__.py"], \
        "the kernels' modules live in its sub-packages; its __init__.py is the entry points"
    rank = {part: i for i, layer in enumerate(KERNEL_LAYERS) for part in layer}
    for name in MODULES:
        if not name.startswith(f"{PACKAGE}.kernels."):
            continue
        here = _kernels_part(name)
        for m in _internal(name):
            there = _kernels_part(m)
            assert there and (there == here or rank[there] > rank[here]), \
                f"{name} ({here}) imports {m} ({there or 'the entry points'}): against the layers"
    for part in parts:  # each sub-package says what it holds
        doc = ast.get_docstring(ast.parse((ROOT / "kernels" / part / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"kernels/{part}/__init__.py: a docstring saying what it holds"


def test_no_folder_holds_more_than_15_modules():
    for folder in {p.parent for p in ROOT.rglob("*.py")}:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder.relative_to(ROOT.parent)}: {len(modules)} modules {sorted(modules)}"


def test_compat_is_a_leaf():
    assert not _internal(f"{PACKAGE}.compat"), _internal(f"{PACKAGE}.compat")


def test_only_hooked_assembles_the_protocol_mtp_and_the_plan():
    trio = {f"{PACKAGE}.postprocess", f"{PACKAGE}.mtp", f"{PACKAGE}.schedule_plan"}
    assembling = [m for m in MODULES if trio <= _internal(m)]
    assert assembling == [f"{PACKAGE}.hooked"], assembling


def test_the_reader_sees_real_modules():
    """The parse above reads the modules it should (a guard against a test that checks nothing)."""
    assert {f"{PACKAGE}.compat", f"{PACKAGE}.hooked", f"{PACKAGE}.kernels.passes.ops"} <= set(MODULES)
    assert f"{PACKAGE}.compat" in _internal(f"{PACKAGE}.mtp")
    assert "torch" in _external(f"{PACKAGE}.kernels.common.autograd")


def test_release_independent_tests_touch_no_release_specific_code():
    """Test modules marked ``release_independent`` (CI runs them on one Megatron Core family per
    Python version, not on each) use the kernels alone: of this package only ``kernels`` and
    ``testing.run_on_ranks``, of Megatron Core only ``parallel_state`` (for the ranks' groups),
    and of the other test modules only such modules and the helpers that import nothing of
    either."""
    tests = pathlib.Path(__file__).parent
    marked = {p.stem for p in tests.glob("test_*.py")
              if "pytestmark = pytest.mark.release_independent" in p.read_text()}
    assert {"test_kernels", "test_triton_backend", "test_edge_inputs"} <= marked
    helpers = {"tolerances", "gloo_ranks"}
    for stem in sorted(marked):
        for node in ast.walk(ast.parse((tests / f"{stem}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                mod, names = node.module or "", {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                mod, names = "", {a.name for a in node.names}
            else:
                continue
            where = f"{stem}: from {mod} import {sorted(names)}"
            for full in ([mod] if mod else sorted(names)):
                top = full.split(".")[0]
                if top == PACKAGE:
                    assert (full == f"{PACKAGE}.kernels" or full.startswith(f"{PACKAGE}.kernels.")
                            or (full == f"{PACKAGE}.testing" and names == {"run_on_ranks"})), where
                elif top == "megatron":
                    assert full == "megatron.core" and names == {"parallel_state"}, where
                elif (tests / f"{top}.py").exists():
                    assert top in marked or top in helpers, where


def test_the_tests_leave_nothing_in_the_clone():
    """Hypothesis keeps its example database off and its caches in the temporary directory
    (tests/conftest.py): a run as the README says leaves no ``.hypothesis/`` in the clone."""
    from hypothesis import settings
    from hypothesis.configuration import storage_directory

    clone = pathlib.Path(__file__).resolve().parent.parent
    where = storage_directory()
    where = pathlib.Path(getattr(where, "path", where))  # an object with .path on newer releases
    assert clone not in where.resolve().parents
    assert settings.default.database is None
