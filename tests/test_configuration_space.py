"""The configuration space, sampled (see ``configuration_space.py``): a deterministic set covering
every pair of options, and random draws (new ones each local run; fixed under CI)."""

from __future__ import annotations

import os
import random

import pytest

from configuration_space import OPTIONS, covering_set, merged, random_combos, readme_table, run_all, table
from mcore_hooks.testing import run_on_ranks


def _run(combos):
    rows = merged(run_on_ranks(run_all, 4, combos, tp=2, cp=2, timeout=900))
    failures = [f"{c.name()}: {problem}" for c, problem, _ in rows if problem]
    assert not failures, "\n".join(failures)
    return rows


def test_the_covering_set_covers_every_pair():
    """Every pair of option values meets in a row that runs (is checked exact), or, where the
    pair is refused whatever else is set, in a refused row."""
    import itertools

    from configuration_space import _refused_pair, expected_refusal, valid

    rows = covering_set()
    names = list(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        for va in OPTIONS[a]:
            for vb in OPTIONS[b]:
                if valid({a: va, b: vb}):
                    wanted_refused = _refused_pair(a, va, b, vb)
                    assert any(getattr(r, a) == va and getattr(r, b) == vb
                               and (expected_refusal(r) is not None) == wanted_refused
                               for r in rows), (a, va, b, vb)
    assert all(valid(vars(r)) for r in rows)


@pytest.mark.slow
def test_every_pair_of_options_is_exact_or_refused():
    """... and docs/testing.md's matrix is this run's (regenerate it with
    ``python tests/configuration_space.py``)."""
    rows = _run(covering_set())
    assert readme_table() == table(rows), "docs/testing.md's configuration-space table is stale"


def test_random_combinations_are_exact_or_refused():
    seed = 0 if os.environ.get("CI") else random.SystemRandom().randrange(2**31)
    print(f"configuration-space seed {seed} (replay: random_combos(12, {seed}))")
    _run(random_combos(12, seed))
