"""``pytest -p verl_tree_plugin``: verl's own tests run in the tree ``$MCORE_HOOKS_VERL_TREE`` (an
unpacked sdist, patched or not) on the CPU, with ``tests/verl_stubs.py``'s stand-ins (Ray, verl's
accelerator platform), and with ``MCORE_HOOKS_HIDDEN=1`` as where mcore-hooks is not installed
(``import mcore_hooks`` raises ImportError). Loaded by ``tests/test_verl_series.py`` in a
process of its own, before anything imports verl."""

import os
import sys

import verl_stubs

if os.environ.get("MCORE_HOOKS_HIDDEN") == "1":
    sys.modules["mcore_hooks"] = None
verl_stubs.use_verl_tree(os.environ["MCORE_HOOKS_VERL_TREE"])
