"""Confidence intervals for pass@k over a benchmark's problems, and for the difference of two models on them.

Contract. The inputs are each problem's (n, c): samples drawn and samples correct. A benchmark's pass@k is the mean
over its problems of the unbiased per-problem estimator (`passk.pass_at_k`). The interval is a seeded percentile
bootstrap over problems: draw P problems with replacement (P = the benchmark's size), recompute the mean of the
unbiased estimator from the drawn problems' (n, c), repeat ``resamples`` times, take the (1 - level) / 2 and
(1 + level) / 2 quantiles. The same resampled problem indices serve every k, so the intervals of one curve come from
one set of resamples, and the same ``seed`` gives the same intervals on any machine (numpy's PCG64 stream).

The paired difference (model B minus model A on the same problems) resamples problem indices once and applies them
to both models, so a problem's difficulty, shared by both, cancels out of the spread; `unpaired_difference` resamples
the two independently (what one would get from two separately reported intervals) and exists to show the gain.

What the interval covers (docs/eval-statistics.md): the variation of the estimate if the benchmark's problems were
drawn again from the same population, which includes each problem's binomial noise from its finite n as far as it
shows in the spread of the per-problem estimates. It does not separate that noise out, say how much a larger n would
narrow the interval, or speak of k > n. `normal_interval` is the analytic (central-limit) alternative; the tests
check it against the bootstrap.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.passk import pass_at_k

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0
_BLOCK = 256  # resamples per vectorized block: bounds the (block, problems, k) array for large benchmarks
METHOD = "percentile bootstrap over problems"


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval [low, high] (fractions, not percent)."""

    estimate: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high}


class IntervalSpecError(UserError, ValueError):
    """An interval setting is out of range; the message names the flag."""


@dataclass(frozen=True)
class IntervalSpec:
    """How intervals are computed; part of every results file, so a reader can recompute them."""

    resamples: int = DEFAULT_RESAMPLES
    level: float = DEFAULT_LEVEL
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.resamples < 10:
            raise IntervalSpecError(f"--resamples: need at least 10 bootstrap resamples, got {self.resamples}")
        if not 0.0 < self.level < 1.0:
            raise IntervalSpecError(f"--level: the interval's confidence level must lie in (0, 1), got {self.level}")

    def to_json(self) -> dict:
        return {"method": METHOD, "resamples": self.resamples, "level": self.level, "seed": self.seed}


def stream_seed(seed: int, *names: str) -> int:
    """A seed per (seed, benchmark, ...): adding a benchmark to a run leaves the other benchmarks' intervals alone."""
    digest = hashlib.sha256("/".join([str(seed), *names]).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def per_problem_pass_at_k(n: np.ndarray, c: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """(problems, len(ks)) array of the unbiased per-problem pass@k."""
    n, c = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if n.ndim != 1 or n.shape != c.shape or n.size == 0:
        raise ValueError(f"per_problem_pass_at_k: need equal-length non-empty 1-d n and c, got {n.shape} and {c.shape}")
    return np.stack([np.asarray(pass_at_k(n, c, np.full_like(n, k)), dtype=np.float64) for k in ks], axis=1)


def _resampled_means(values: Sequence[np.ndarray], spec: IntervalSpec, seed: int) -> list[np.ndarray]:
    """For each (problems, K) array in ``values`` (same problems), the (resamples, K) means over the SAME resampled
    problem indices."""
    problems = values[0].shape[0]
    rng = np.random.default_rng(seed)
    out = [np.empty((spec.resamples, v.shape[1])) for v in values]
    for start in range(0, spec.resamples, _BLOCK):
        stop = min(start + _BLOCK, spec.resamples)
        idx = rng.integers(0, problems, size=(stop - start, problems))
        for v, o in zip(values, out):
            o[start:stop] = v[idx].mean(axis=1)
    return out


def _quantiles(draws: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail], axis=0)
    return low, high


def _intervals(estimates: np.ndarray, draws: np.ndarray, ks: Sequence[int], level: float) -> dict[int, Interval]:
    low, high = _quantiles(draws, level)
    return {int(k): Interval(float(e), float(lo), float(hi)) for k, e, lo, hi in zip(ks, estimates, low, high)}


def bootstrap_values(
    values: np.ndarray, ks: Sequence[int], spec: IntervalSpec = IntervalSpec(), stream: str = ""
) -> dict[int, Interval]:
    """The mean over problems of a (problems, len(ks)) array of per-problem values (pass@k, or its mean over several
    runs, or a difference of two models) with its bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != len(ks) or values.shape[0] == 0:
        raise ValueError(f"bootstrap_values: need a (problems, {len(ks)}) array, got shape {values.shape}")
    (draws,) = _resampled_means([values], spec, stream_seed(spec.seed, stream))
    return _intervals(values.mean(axis=0), draws, ks, spec.level)


def bootstrap_pass_at_k(
    n, c, ks: Sequence[int], spec: IntervalSpec = IntervalSpec(), stream: str = ""
) -> dict[int, Interval]:
    """pass@k per k with its bootstrap interval; ``stream`` (e.g. the benchmark) picks the resampling stream."""
    return bootstrap_values(per_problem_pass_at_k(n, c, ks), ks, spec, stream)


def _check_paired(n_a, n_b) -> None:
    if np.shape(n_a) != np.shape(n_b):
        raise ValueError(f"paired_difference: the runs hold {np.size(n_a)} and {np.size(n_b)} problems; need the same")


def paired_difference(
    n_a, c_a, n_b, c_b, ks: Sequence[int], spec: IntervalSpec = IntervalSpec(), stream: str = ""
) -> dict[int, Interval]:
    """pass@k(B) - pass@k(A) per k, problems aligned by position, with a paired bootstrap interval."""
    _check_paired(n_a, n_b)
    a, b = per_problem_pass_at_k(n_a, c_a, ks), per_problem_pass_at_k(n_b, c_b, ks)
    return bootstrap_values(b - a, ks, spec, stream + "/paired")


def unpaired_difference(
    n_a, c_a, n_b, c_b, ks: Sequence[int], spec: IntervalSpec = IntervalSpec(), stream: str = ""
) -> dict[int, Interval]:
    """The same difference with A and B resampled independently (ignores that the problems are shared)."""
    a, b = per_problem_pass_at_k(n_a, c_a, ks), per_problem_pass_at_k(n_b, c_b, ks)
    (draws_a,) = _resampled_means([a], spec, stream_seed(spec.seed, stream, "unpaired-a"))
    (draws_b,) = _resampled_means([b], spec, stream_seed(spec.seed, stream, "unpaired-b"))
    return _intervals(b.mean(axis=0) - a.mean(axis=0), draws_b - draws_a, ks, spec.level)


def normal_quantile(p: float) -> float:
    """The standard normal's quantile by bisection on erf (no scipy needed; 1e-12 accurate)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def normal_interval(n, c, ks: Sequence[int], level: float = DEFAULT_LEVEL) -> dict[int, Interval]:
    """The analytic alternative: mean +- z * sd / sqrt(P) of the per-problem estimates (central limit theorem)."""
    values = per_problem_pass_at_k(n, c, ks)
    problems = values.shape[0]
    z = normal_quantile(0.5 + level / 2.0)
    mean = values.mean(axis=0)
    half = z * (values.std(axis=0, ddof=1) if problems > 1 else np.zeros_like(mean)) / math.sqrt(problems)
    return {int(k): Interval(float(m), float(m - h), float(m + h)) for k, m, h in zip(ks, mean, half)}


def sign_test(a_only: int, b_only: int) -> float:
    """Exact two-sided sign test on discordant problems: the probability, if each discordant problem were equally
    likely to favour A or B, of a split at least as uneven as (a_only, b_only). 1.0 when there are none."""
    if a_only < 0 or b_only < 0:
        raise ValueError(f"sign_test: counts must be >= 0, got {a_only}, {b_only}")
    m = a_only + b_only
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(a_only, b_only) + 1))
    return min(1.0, float(Fraction(tail, 2 ** (m - 1))))  # exact integers: no overflow at thousands of problems
