"""Candidate dynamics: rank-k probability and entropy series over steps, token-weighted averages, entropy histograms.

The numbers themselves come from the loss/statistics pass (``megatron_rlvr.algos.metrics`` names them
``rank{k}_prob``, ``entropy``, ``*_high_entropy``; the actor logs them under ``policy/`` and ``loss/``). This module
only combines and reshapes them for logs and plots.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# Where each quantity may be found in a metrics record, in order of preference: the actor's statistics pass over
# all response tokens ("policy/"), then the update pass's loss metrics ("loss/"), then bare loss-metric names.
RANK_KEYS = {k: (f"policy/rank{k}_prob", f"loss/rank{k}_prob", f"rank{k}_prob") for k in (1, 2, 3)}
RANK_HIGH_ENTROPY_KEYS = {
    k: (f"policy/rank{k}_prob_high_entropy", f"loss/rank{k}_prob_high_entropy", f"rank{k}_prob_high_entropy")
    for k in (1, 2, 3)
}
ENTROPY_KEYS = ("policy/entropy", "loss/entropy", "entropy")
ENTROPY_HIGH_KEYS = ("loss/entropy_high_entropy", "policy/entropy_high_entropy", "entropy_high_entropy")
REWARD_KEYS = ("reward/mean", "reward")


def first_present(record: Mapping[str, Any], keys: Iterable[str]) -> float | None:
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def series(records: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> tuple[list[int], list[float]]:
    """(steps, values) of the first of ``keys`` present in each record; records without any are left out."""
    keys = tuple(keys)
    steps, values = [], []
    for r in records:
        value = first_present(r, keys)
        if value is not None and "step" in r:
            steps.append(int(r["step"]))
            values.append(value)
    return steps, values


def top_mass(records: Sequence[Mapping[str, Any]], keys: Mapping[int, Iterable[str]]) -> tuple[list[int], list[float]]:
    """(steps, rank-1 + rank-2 + rank-3 probability): the mass of the top-3 candidates (CaSP's N = 3), at the steps
    whose record holds all three ranks (``keys``: RANK_KEYS or RANK_HIGH_ENTROPY_KEYS)."""
    steps, values = [], []
    for r in records:
        ranks = [first_present(r, keys[k]) for k in (1, 2, 3)]
        if "step" in r and all(p is not None for p in ranks):
            steps.append(int(r["step"]))
            values.append(float(sum(ranks)))  # type: ignore[arg-type]
    return steps, values


def candidate_dynamics(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """The series the paper's evidence needs: rank-1/2/3 probabilities and the top-3 mass (all tokens and forking
    tokens), entropy, reward."""
    out = {}
    for k in (1, 2, 3):
        out[f"rank{k}_prob"] = series(records, RANK_KEYS[k])
        out[f"rank{k}_prob_high_entropy"] = series(records, RANK_HIGH_ENTROPY_KEYS[k])
    out["top3_mass"] = top_mass(records, RANK_KEYS)
    out["top3_mass_high_entropy"] = top_mass(records, RANK_HIGH_ENTROPY_KEYS)
    out["entropy"] = series(records, ENTROPY_KEYS)
    out["entropy_high_entropy"] = series(records, ENTROPY_HIGH_KEYS)
    out["reward"] = series(records, REWARD_KEYS)
    return {name: s for name, s in out.items() if s[0]}


def histogram(
    values: Sequence[float] | np.ndarray, bins: int = 50, value_range: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Counts over ``bins`` equal bins plus summary statistics; non-finite values are counted and left out."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    finite = arr[np.isfinite(arr)]
    if value_range is None:
        value_range = (0.0, float(finite.max()) if finite.size and finite.max() > 0 else 1.0)
    counts, edges = np.histogram(finite, bins=bins, range=value_range)
    summary = {
        "count": int(finite.size),
        "nonfinite": int(arr.size - finite.size),
        "mean": float(finite.mean()) if finite.size else 0.0,
    }
    for q in (0.5, 0.8, 0.95):
        summary[f"q{int(q * 100)}"] = float(np.quantile(finite, q)) if finite.size else 0.0
    return {"edges": edges.tolist(), "counts": counts.tolist(), **summary}
