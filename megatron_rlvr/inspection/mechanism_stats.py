"""Intervals for the CaSP mechanism study's probe statistics (docs/casp-mechanism.md, "Intervals").

A probe statistic of a checkpoint is a ratio over prompts: ``sum over prompts of its per-prompt sums / sum of their
position counts`` (probe_summary.py). Its interval is a seeded percentile bootstrap over the probe's prompts, the
unit that is drawn independently (the positions of one response are not): draw P prompts with replacement,
recompute, repeat. Every quantity of one comparison (two arms, a checkpoint and the base, several seed pairs) is
recomputed on the SAME resampled prompts, so what the prompts share cancels out of a difference, as in the eval's
paired pass@k intervals (eval/bootstrap.py, whose `IntervalSpec` and seed streams these reuse).

Over seeds, ``seed_interval`` is the Student-t interval of the mean of per-seed values: with three seed pairs its
half-width is 4.30 standard errors, which is what three seeds can say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megatron_rlvr.eval.bootstrap import Interval, IntervalSpec, stream_seed

# a function of resampled prompt indices (an int array of length P) -> the quantity at those prompts
Quantity = Callable[[np.ndarray], float]


def ratio(sums: np.ndarray, counts: np.ndarray) -> Quantity:
    """sum(sums[idx]) / sum(counts[idx]): a statistic's mean over the positions of the drawn prompts (nan if none)."""
    sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)

    def at(idx: np.ndarray) -> float:
        total = counts[idx].sum()
        return float(sums[idx].sum() / total) if total > 0 else math.nan

    return at


def statistic(scores: dict[str, Any], scope: str, name: str) -> Quantity:
    """A scores file's statistic ``name`` over ``scope`` (``all`` or ``forking`` positions)."""
    return ratio(np.asarray(scores["sums"][scope][name]), np.asarray(scores["counts"][scope]))


def rare_logp(scores: dict[str, Any], per_token: bool = False) -> Quantity:
    """The mean log-probability of the base's rare correct responses (per response, or per token), clustered by
    prompt."""
    prompts = len(scores["prompts"])
    sums, counts = np.zeros(prompts), np.zeros(prompts)
    for r in scores["rare"]:
        sums[r["prompt"]] += r["logp"]
        counts[r["prompt"]] += r["tokens"] if per_token else 1
    return ratio(sums, counts)


def difference(b: Quantity, a: Quantity) -> Quantity:
    return lambda idx: b(idx) - a(idx)


def mean_of(quantities: Sequence[Quantity]) -> Quantity:
    return lambda idx: float(np.mean([q(idx) for q in quantities]))


def prompt_interval(
    quantity: Quantity, prompts: int, spec: IntervalSpec = IntervalSpec(), stream: str = ""
) -> Interval:
    """``quantity`` at every prompt with its percentile bootstrap interval over prompts (nan-valued resamples, which
    drew no position of a scope, are left out)."""
    rng = np.random.default_rng(stream_seed(spec.seed, "probe", stream))
    everything = np.arange(prompts)
    draws = np.array([quantity(rng.integers(0, prompts, size=prompts)) for _ in range(spec.resamples)])
    draws = draws[np.isfinite(draws)]
    tail = (1.0 - spec.level) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail]) if draws.size else (math.nan, math.nan)
    return Interval(quantity(everything), float(low), float(high))


def student_t_quantile(p: float, df: int) -> float:
    """The Student-t quantile (no scipy here): bisection on the CDF, the density integrated by Simpson's rule."""
    if df < 1:
        raise ValueError(f"student_t_quantile: df must be >= 1, got {df}")
    if p == 0.5:
        return 0.0
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(t: float) -> float:
        steps = 4000
        h = t / steps
        xs = np.linspace(0.0, t, steps + 1)
        pdf = np.exp(log_norm - (df + 1) / 2 * np.log1p(xs * xs / df))
        integral = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
        return 0.5 + integral

    target = p if p > 0.5 else 1 - p
    lo, hi = 0.0, 1.0
    while cdf(hi) < target:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < target else (lo, mid)
    t = (lo + hi) / 2
    return t if p > 0.5 else -t


def seed_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of per-seed values with its Student-t interval (mean +- t * sd / sqrt(n)); one value: no width
    (nan ends)."""
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    mean = float(arr.mean())
    if arr.size == 1:
        return Interval(mean, math.nan, math.nan)
    half = student_t_quantile(0.5 + level / 2, arr.size - 1) * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    return Interval(mean, mean - half, mean + half)


def verdict(predicted: int, over_prompts: Interval, over_seeds: Interval | None) -> str:
    """The fixed rule (docs/casp-mechanism.md, "Verdicts"): ``holds`` when every interval given excludes 0 on the
    predicted side (``predicted`` = +1 or -1), ``fails`` when every one excludes it on the other side, else
    ``cannot tell``."""
    intervals = [over_prompts] + ([over_seeds] if over_seeds is not None else [])
    if any(not (math.isfinite(iv.low) and math.isfinite(iv.high)) for iv in intervals):
        return "cannot tell"
    if all(iv.low > 0 if predicted > 0 else iv.high < 0 for iv in intervals):
        return "holds"
    if all(iv.high < 0 if predicted > 0 else iv.low > 0 for iv in intervals):
        return "fails"
    return "cannot tell"


def threshold_verdict(over_prompts: Interval, threshold: float) -> str:
    """``holds`` when the interval lies above ``threshold``, ``fails`` below it, else ``cannot tell``."""
    if over_prompts.low > threshold:
        return "holds"
    if over_prompts.high < threshold:
        return "fails"
    return "cannot tell"


def interval_text(iv: Interval | dict | None, digits: int = 4, scale: float = 1.0, signed: bool = True) -> str:
    """``estimate [low, high]`` for tables (an Interval or its JSON form; ``scale`` 100 for percent); the estimate
    alone when the interval has no width (one seed), ``-`` for none."""
    if iv is None:
        return "-"
    e, lo, hi = (iv.estimate, iv.low, iv.high) if isinstance(iv, Interval) else (iv["estimate"], iv["low"], iv["high"])
    f = f"{'+' if signed else ''}.{digits}f"
    if not math.isfinite(lo):
        return f"{e * scale:{f}}"
    return f"{e * scale:{f}} [{lo * scale:{f}}, {hi * scale:{f}}]"
