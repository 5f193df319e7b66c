"""Overtakes against a plain count: random admissions, queries and rebases."""

from __future__ import annotations

import random

import pytest

from rlt_engine.core.overtakes import Overtakes


@pytest.mark.parametrize("seed", range(20))
def test_later_counts_the_admissions_of_later_arrivals(seed):
    rng = random.Random(seed)
    tree, admitted, oldest = Overtakes(), [], 0
    for arrival in range(600):
        if rng.random() < 0.7:  # admit an arrival that is still remembered
            a = rng.randint(oldest, arrival)
            tree.admitted(a)
            admitted.append(a)
        if rng.random() < 0.05:  # forget up to a later point, never past what is queried
            oldest = rng.randint(oldest, arrival)
            tree.forget_before(oldest)
            assert tree.base == oldest
        probe = rng.randint(oldest, arrival + 5)
        assert tree.later(probe) == sum(1 for a in admitted if a > probe)


def test_forgotten_arrivals_are_refused():
    tree = Overtakes()
    tree.admitted(3)
    tree.forget_before(2)
    with pytest.raises(ValueError, match="forgotten"):
        tree.admitted(1)
    with pytest.raises(ValueError, match="forgotten"):
        tree.later(1)
    assert tree.later(2) == 1 and tree.later(3) == 0
