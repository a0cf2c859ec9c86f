"""Bootstrap intervals of pass@k: reproducible by seed, ~95% coverage of a known true pass@k (simulation), paired
narrower than unpaired on correlated runs, the analytic interval agreeing, the exact sign test by hand."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.bootstrap import (
    IntervalSpec,
    bootstrap_pass_at_k,
    normal_interval,
    paired_difference,
    per_problem_pass_at_k,
    sign_test,
    unpaired_difference,
)
from megatron_rlvr.eval.passk import pass_at_k


def _beta_problems(rng, problems: int, n: int, a: float = 0.5, b: float = 2.0):
    p = rng.beta(a, b, size=problems)
    return p, np.full(problems, n), rng.binomial(n, p)


def _true_population_pass_at_k(a: float, b: float, k: int) -> float:
    """E[1 - (1 - p)^k] for p ~ Beta(a, b): 1 - B(a, b + k) / B(a, b) = 1 - prod_j (b + j) / (a + b + j)."""
    return 1.0 - float(np.prod([(b + j) / (a + b + j) for j in range(k)]))


def test_intervals_are_reproducible_by_seed_and_per_benchmark_stream():
    rng = np.random.default_rng(7)
    _, n, c = _beta_problems(rng, 60, 16)
    ks = [1, 4, 16]
    first = bootstrap_pass_at_k(n, c, ks, IntervalSpec(resamples=500, seed=3), stream="math500")
    again = bootstrap_pass_at_k(n.copy(), c.copy(), ks, IntervalSpec(resamples=500, seed=3), stream="math500")
    assert first == again  # bit for bit
    other_seed = bootstrap_pass_at_k(n, c, ks, IntervalSpec(resamples=500, seed=4), stream="math500")
    other_stream = bootstrap_pass_at_k(n, c, ks, IntervalSpec(resamples=500, seed=3), stream="aime24")
    for k in ks:
        assert (
            first[k].estimate == other_seed[k].estimate == pytest.approx(np.mean(pass_at_k(n, c, np.full_like(n, k))))
        )
        assert first[k].low <= first[k].estimate <= first[k].high
    assert any(first[k].low != other_seed[k].low or first[k].high != other_seed[k].high for k in ks)
    assert any(first[k].low != other_stream[k].low for k in ks)


def test_coverage_of_a_known_true_pass_at_k_is_near_95_percent():
    """2000 simulated benchmarks of 50 problems (difficulty p ~ Beta(0.5, 2), c ~ Binomial(16, p)), 500 bootstrap
    resamples each: the share of 95% intervals holding the population's true pass@k, per k. Monte Carlo standard
    error at 2000 trials: 0.5 points, so [93%, 97%] is about +-4 standard errors."""
    trials, problems, n, ks = 2000, 50, 16, [1, 4, 16]
    a, b = 0.5, 2.0
    truth = {k: _true_population_pass_at_k(a, b, k) for k in ks}
    rng = np.random.default_rng(2026)
    spec = IntervalSpec(resamples=500, seed=0)
    covered = dict.fromkeys(ks, 0)
    for trial in range(trials):
        _, nn, c = _beta_problems(rng, problems, n, a, b)
        intervals = bootstrap_pass_at_k(nn, c, ks, spec, stream=f"trial{trial}")
        for k in ks:
            covered[k] += intervals[k].low <= truth[k] <= intervals[k].high
    coverage = {k: covered[k] / trials for k in ks}
    print(f"coverage over {trials} trials: {coverage}")
    for k in ks:
        assert 0.93 <= coverage[k] <= 0.97, coverage


def test_paired_interval_is_narrower_than_unpaired_on_correlated_runs():
    """Two models on the same 200 problems, B a little better on each: their per-problem results share the
    problem's difficulty, which the paired bootstrap cancels and the unpaired one counts twice."""
    rng = np.random.default_rng(11)
    p = rng.beta(0.7, 1.5, size=200)
    n = np.full(200, 32)
    c_a, c_b = rng.binomial(32, p), rng.binomial(32, np.minimum(1.0, 1.15 * p))
    ks = [1, 8, 32]
    spec = IntervalSpec(resamples=2000, seed=0)
    paired = paired_difference(n, c_a, n, c_b, ks, spec, stream="b")
    unpaired = unpaired_difference(n, c_a, n, c_b, ks, spec, stream="b")
    for k in ks:
        assert paired[k].estimate == pytest.approx(unpaired[k].estimate)
        width_p, width_u = paired[k].high - paired[k].low, unpaired[k].high - unpaired[k].low
        print(f"k={k}: paired width {100 * width_p:.2f}, unpaired {100 * width_u:.2f} points")
        assert width_p < 0.7 * width_u  # 0.22 at k = 1 here; at k = n a problem is solved or not: 0.64
    assert paired[1].low > 0 > unpaired[32].low  # the pairing separates what the two separate intervals cannot
    with pytest.raises(ValueError, match="200 and 199 problems"):
        paired_difference(n, c_a, n[:-1], c_b[:-1], ks, spec)


def test_the_normal_interval_matches_the_bootstrap():
    rng = np.random.default_rng(5)
    _, n, c = _beta_problems(rng, 300, 32)
    ks = [1, 4, 32]
    boot = bootstrap_pass_at_k(n, c, ks, IntervalSpec(resamples=4000, seed=1))
    normal = normal_interval(n, c, ks)
    for k in ks:
        width = boot[k].high - boot[k].low
        assert normal[k].estimate == pytest.approx(boot[k].estimate)
        assert abs(normal[k].low - boot[k].low) < 0.1 * width and abs(normal[k].high - boot[k].high) < 0.1 * width


def test_sign_test_matches_a_hand_computation():
    # 2 vs 8 discordant: P(X <= 2) for X ~ Bin(10, 1/2) = (1 + 10 + 45) / 1024; two-sided: twice that
    assert sign_test(2, 8) == 2 * 56 / 1024 == 0.109375
    assert sign_test(8, 2) == 0.109375
    assert sign_test(0, 5) == 2 / 32  # all five discordant problems one way
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert 0.0 < sign_test(1500, 1600) < 1.0  # exact integers: no float overflow at thousands of problems
    with pytest.raises(ValueError):
        sign_test(-1, 2)


def test_bad_interval_settings_name_the_flag():
    with pytest.raises(UserError, match="--resamples"):
        IntervalSpec(resamples=5)
    with pytest.raises(UserError, match="--level"):
        IntervalSpec(level=95)
    assert per_problem_pass_at_k(np.array([4, 4]), np.array([0, 4]), [1, 4]).tolist() == [[0.0, 0.0], [1.0, 1.0]]
