"""The API reference names only what exists, and every public name of the package is in it; the
guides' code references resolve."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import mcore_hooks

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _documented() -> list[str]:
    return re.findall(r"^::: ([\w.]+)\s*$", (DOCS / "reference.md").read_text(), flags=re.M)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_documented_name_imports():
    names = _documented()
    assert len(names) >= 25
    for dotted in names:
        assert _resolve(dotted) is not None, dotted


def test_every_public_name_is_documented():
    documented = {d.rsplit(".", 1)[-1] for d in _documented()}
    assert set(mcore_hooks.__all__) <= documented, set(mcore_hooks.__all__) - documented


def test_guides_name_real_things():
    """What the guides' code blocks import from mcore_hooks exists."""
    checked = 0
    for guide in ("index.md", "migration.md", "processors.md", "policy-loss.md", "rollout.md", "../README.md"):
        for block in re.findall(r"```python\n(.*?)```", (DOCS / guide).read_text(), flags=re.S):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mcore_hooks"):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), (guide, node.module, alias.name)
                        checked += 1
    assert checked >= 8
