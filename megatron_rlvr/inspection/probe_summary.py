"""One checkpoint's probe scores as a small results file: per-prompt sums of every statistic over the probe rows'
positions (all of them, and the base's forking ones), and the log-probability of each rare correct response.

Per-prompt sums and counts, not per-position values, because the prompt is the unit every interval resamples
(positions of one response are not independent draws): the mean of a statistic over a set of prompts is
``sum of their sums / sum of their counts``. The statistics (docs/casp-mechanism.md):

- ``rank1``, ``rank2``, ``rank3``: the rank-k probabilities; ``top3`` their sum; ``gap`` rank-1 minus rank-2;
- ``entropy`` (nats); ``logp``: the log-probability of the base's own token at the position;
- ``rank3_below``: 1 where the rank-3 probability is below ``RANK3_THRESHOLD`` (the paper's appendix D.2);
- ``distinct@K``: the expected number of distinct tokens in K draws from the position's distribution.

Rare correct responses: per response its prompt, sample, token count and summed log-probability. And over all probe
positions, by bins of the rank-1 probability (``RANK1_BINS`` equal bins of [0, 1]): the positions and their summed
``distinct@K``, the curve of appendix B.2 (E_K falls to 1 as rank 1 goes to 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rlvr.errors import UserError
from megatron_rlvr.inspection.probe_set import ProbeSet
from megatron_rlvr.inspection.probe_stats import field_names

SCORES_FORMAT = "megatron-rlvr probe scores 1"
RANK3_THRESHOLD = 0.05
RANK1_BINS = 20
SCOPES = ("all", "forking")


class ProbeScoresError(UserError, ValueError):
    """A scores file that is missing, malformed or of another probe set: the message names it."""


def statistic_names(ks: Sequence[int]) -> list[str]:
    return ["rank1", "rank2", "rank3", "top3", "gap", "entropy", "logp", "rank3_below", *(f"distinct@{k}" for k in ks)]


def per_position(values: torch.Tensor, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """Every statistic at the positions of ``values`` [F, T] (rows in `field_names` order), float64."""
    rows = dict(zip(field_names(ks), values.to(torch.float64).numpy()))
    out = {
        "rank1": rows["rank1"],
        "rank2": rows["rank2"],
        "rank3": rows["rank3"],
        "top3": rows["rank1"] + rows["rank2"] + rows["rank3"],
        "gap": rows["rank1"] - rows["rank2"],
        "entropy": rows["entropy"],
        "logp": rows["logp"],
        "rank3_below": (rows["rank3"] < RANK3_THRESHOLD).astype(np.float64),
    }
    out.update({f"distinct@{k}": rows[f"distinct@{k}"] for k in ks})
    return out


def summarize(probe_set: ProbeSet, values: torch.Tensor, ks: Sequence[int]) -> dict[str, Any]:
    """``values`` [rows, F, S - 1] from `ProbeScorer.score` on ``probe_set.batch`` -> per-prompt sums and counts per
    scope, the rare responses' log-probabilities and the pooled means."""
    names = statistic_names(ks)
    prompts = len(probe_set.prompts)
    sums = {scope: {name: np.zeros(prompts) for name in names} for scope in SCOPES}
    counts = {scope: np.zeros(prompts, dtype=np.int64) for scope in SCOPES}
    rare = []
    bins = {"count": np.zeros(RANK1_BINS, dtype=np.int64), **{f"distinct@{k}": np.zeros(RANK1_BINS) for k in ks}}
    for r, row in enumerate(probe_set.rows):
        start = len(probe_set.prompts[row.prompt].prompt_ids) - 1
        window = values[r, :, start : start + len(row.ids)]
        if row.rare:
            logp = float(window[0].to(torch.float64).sum())
            rare.append({"prompt": row.prompt, "sample": row.sample, "tokens": len(row.ids), "logp": logp})
        if not row.probe:
            continue
        stats = per_position(window, ks)
        which = np.minimum((stats["rank1"] * RANK1_BINS).astype(np.int64), RANK1_BINS - 1)
        bins["count"] += np.bincount(which, minlength=RANK1_BINS)
        for k in ks:
            bins[f"distinct@{k}"] += np.bincount(which, weights=stats[f"distinct@{k}"], minlength=RANK1_BINS)
        for scope, where in (("all", slice(None)), ("forking", np.asarray(row.forking, dtype=np.int64))):
            for name in names:
                sums[scope][name][row.prompt] += float(stats[name][where].sum())
            counts[scope][row.prompt] += len(stats["rank1"][where])
    means = {
        scope: {name: float(sums[scope][name].sum() / max(counts[scope].sum(), 1)) for name in names}
        for scope in SCOPES
    }
    if rare:
        means["rare"] = {
            "logp": float(np.mean([x["logp"] for x in rare])),
            "logp_per_token": float(sum(x["logp"] for x in rare) / sum(x["tokens"] for x in rare)),
        }
    return {
        "prompts": [p.id for p in probe_set.prompts],
        "counts": {scope: counts[scope].tolist() for scope in SCOPES},
        "sums": {
            scope: {name: [round(v, 9) for v in sums[scope][name].tolist()] for name in names} for scope in SCOPES
        },
        "rare": rare,
        "by_rank1": {name: [round(float(v), 6) for v in values] for name, values in bins.items()},
        "means": means,
    }


def scores_json(
    label: str, checkpoint: str, probe_set: ProbeSet, summary: Mapping[str, Any], settings: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "format": SCORES_FORMAT,
        "label": label,
        "checkpoint": str(checkpoint),
        "probe_set": probe_set.digest(),
        "settings": dict(settings),
        "rank3_threshold": RANK3_THRESHOLD,
        **summary,
    }


def write_scores(path: str | os.PathLike, payload: Mapping[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=None, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def load_scores(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ProbeScoresError(f"{path}: no such scores file (written by `megatron-rlvr probe score`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProbeScoresError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != SCORES_FORMAT:
        raise ProbeScoresError(f'{path}: not a probe scores file (expected "format": {SCORES_FORMAT!r})')
    for key in ("probe_set", "prompts", "counts", "sums", "rare", "settings"):
        if key not in data:
            raise ProbeScoresError(f"{path}: no {key!r} field")
    return data


def is_current(path: str | os.PathLike, digest: str, settings: Mapping[str, Any]) -> bool:
    """Whether ``path`` holds scores of this probe set under these settings (a rerun skips it)."""
    try:
        data = load_scores(path)
    except ProbeScoresError:
        return False
    return data["probe_set"] == digest and data["settings"] == dict(settings)
