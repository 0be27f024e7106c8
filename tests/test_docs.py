"""The API reference names only what exists, and every public name of the package is in it; the
guides' code references resolve."""

from __future__ import annotations

import ast
import importlib
import inspect
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
    for guide in ("index.md", "usage.md", "mtp-and-plan.md", "testing.md", "performance.md", "migration.md",
                  "processors.md", "policy-loss.md", "rollout.md", "../README.md"):
        for block in re.findall(r"```python\n(.*?)```", (DOCS / guide).read_text(), flags=re.S):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mcore_hooks"):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), (guide, node.module, alias.name)
                        checked += 1
    assert checked >= 8


def _documented_callables():
    """Every documented name, and the public methods the reference renders with it."""
    for dotted in _documented():
        obj = _resolve(dotted)
        yield dotted, obj
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") and callable(member):
                    yield f"{dotted}.{name}", member


def _arg_names(doc: str) -> list[str]:
    """The names a Google-style ``Args:`` section documents (its entries' first words)."""
    names = []
    lines = inspect.cleandoc(doc).splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Args:":
            continue
        indent = None
        for entry in lines[i + 1:]:
            if not entry.strip():
                break
            width = len(entry) - len(entry.lstrip())
            indent = width if indent is None else indent
            if width < indent:
                break
            if width == indent:
                names.append(entry.strip().split(":", 1)[0].split(" (", 1)[0].lstrip("*"))
    return names


def test_docstring_args_name_real_parameters():
    """mkdocs --strict (in CI, after every test family) refuses an ``Args:`` entry that is not
    one parameter of the signature, such as ``a, b: ...``: caught here in seconds instead."""
    checked = 0
    for dotted, obj in _documented_callables():
        target = obj.__init__ if inspect.isclass(obj) else obj  # merge_init_into_class
        doc = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) and target.__doc__:
            doc += "\n\n" + inspect.getdoc(target)
        try:
            params = set(inspect.signature(target).parameters)
        except (TypeError, ValueError):  # a builtin without a signature documents no Args
            continue
        for name in _arg_names(doc):
            assert name in params, f"{dotted}: Args entry {name!r} is not a parameter {sorted(params)}"
            checked += 1
    assert checked >= 50


def _first_result(path: Path) -> str:
    text = path.read_text()
    section = text[text.index("## A first result, on the CPU"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_readmes_first_script_runs_as_pasted_and_prints_its_result():
    """The README's (and the docs landing page's) first script, run as a newcomer pastes it:
    no Megatron notes on stderr, the log-probs and entropies printed, and the difference from
    Megatron's own loss within float32 rounding."""
    import subprocess
    import sys

    script = _first_result(DOCS.parent / "README.md")
    assert script == _first_result(DOCS / "index.md")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=DOCS.parent.parent)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("log p(label): [") and lines[1].startswith("entropy:      [")
    diff = float(lines[2].split(":")[1])
    assert diff < 1e-5, lines
    assert "Warning" not in out.stderr and "deprecated" not in out.stderr.lower(), out.stderr


def _first_screen() -> str:
    text = (DOCS.parent / "README.md").read_text()
    return text[: text.index("## A first result")]


def test_the_readme_says_what_and_for_whom_before_any_number():
    """The first screen: what the library is and for whom, before its headline number, then the
    two set-up commands of each Python line; the headline is the docs landing page's too."""
    screen = _first_screen()
    intro = screen[: screen.index("One number")]
    for words in ("RL post-training", "output_processor", "Megatron Core 0.18", "without patching"):
        assert words in intro, words
    assert not re.search(r"\d+\.\d+ ms", intro)  # no figure before it says what it is
    for line in ('python3.11 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && .venv/bin/mcore-hooks verify',
                 ".venv/bin/python -m pytest",
                 'python3.12 -m venv .venv312 && .venv312/bin/pip install -e ".[test]" megatron-core==0.19.2 && .venv312/bin/mcore-hooks verify',
                 ".venv312/bin/python -m pytest"):
        assert f"\n{line}\n" in screen, line
    headline = re.search(r"\*\*([\d.]+) ms with `PolicyLossProcessor`\s+against the stock path's ([\d.]+) ms\*\*",
                         screen)
    assert headline, "the headline number"
    index = (DOCS / "index.md").read_text()
    assert " ".join(headline.group(0).split()) in " ".join(index.split())
    results = (DOCS.parent / "benchmarks" / "RESULTS.md").read_text()
    assert all(f"| {g} |" in results for g in headline.groups())


def test_the_cli_answers_help_without_importing_torch_or_megatron():
    """``mcore-hooks --help`` / ``--version`` parse before importing anything heavy (they took
    9-33 s on a loaded 2-core machine when torch and Megatron Core came first): the same
    process, asked for its modules after, has neither."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom mcore_hooks.cli import main\n"
            "for argv in (['--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
