"""pass_at_k against the exact rational value computed with big integers."""

import random
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from megatron_rlvr.eval import pass_at_k


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_random_triples_match_exact_rationals():
    rng = random.Random(0)
    triples = [(n, rng.randint(0, n), rng.randint(1, n)) for n in (rng.randint(1, 1024) for _ in range(3000))]
    # the hard corners: tiny results, results near one, the largest n
    triples += [
        (1024, 1, 1),
        (1024, 1, 2),
        (1024, 1023, 1),
        (1024, 512, 1024),
        (1024, 1, 1023),
        (1024, 2, 3),
        (1000, 999, 1),
        (7, 0, 3),
        (7, 7, 7),
        (1, 1, 1),
        (1, 0, 1),
        (1024, 3, 512),
    ]
    ns, cs, ks = (np.array(x) for x in zip(*triples))
    got = pass_at_k(ns, cs, ks)
    worst = 0.0
    for (n, c, k), value in zip(triples, got):
        want = exact(n, c, k)
        if want == 0:
            assert value == 0.0, (n, c, k)
            continue
        rel = abs(Fraction(float(value)) - want) / want
        worst = max(worst, float(rel))
    assert worst < 1e-12, worst


def test_scalar_and_broadcast_forms():
    assert isinstance(pass_at_k(10, 3, 1), float)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, rel=1e-15)
    curve = pass_at_k(1024, 5, np.array([1, 2, 4, 1024]))
    assert curve.shape == (4,) and curve[-1] == 1.0 and np.all(np.diff(curve) > 0)


@pytest.mark.parametrize("n,c,k", [(10, 11, 1), (10, -1, 1), (10, 3, 0), (10, 3, 11), (10.5, 3, 1)])
def test_invalid_inputs_are_errors(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)
