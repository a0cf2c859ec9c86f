"""The CaSP mechanism study's tables and figures, built from its committed results folder alone
(docs/casp-mechanism.md: the claims, statistics, intervals and verdict rule fixed before the runs).

``write_report(results_dir, out_dir)`` reads ``probe/*.json`` (probe_summary.py), ``eval/*.json`` (the eval's
results files) and ``experiment.json`` (the `Design`), and writes:

- ``report.md``: the claims table (per claim the tested statistic, GRPO and CaSP side by side per seed pair, the
  pooled estimate with its interval over prompts and over seeds, the verdict) and the pass@k table (each model's
  pass@k, CaSP - GRPO paired per seed pair and pooled, each arm against the base);
- ``probe_over_steps.png``: the probe's statistics at every probed step, each run a thin line, each arm's mean a
  thick one, PSR and NSR dashed; ``distinct_by_rank1.png``: E_K against the rank-1 probability at the base and the
  final checkpoints (appendix B.2); ``passk.png``: pass@k of the base and each arm with the paired difference;
- ``report.json``: every number of the tables.

Whatever is missing (a run not yet done) is named in the tables, never guessed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.eval.bootstrap import (
    Interval,
    IntervalSpec,
)
from megatron_rlvr.inspection import mechanism_stats as ms
from megatron_rlvr.inspection.mechanism_design import BASE, PAIRED_ARMS, Design, probe_label, run_name
from megatron_rlvr.inspection.mechanism_passk import passk, passk_markdown
from megatron_rlvr.inspection.mechanism_results import RARE, Results

FORK_ENTROPY_NEAR_ZERO = 0.1  # "near zero": forking entropy below 10% of the base's


@dataclass
class ClaimRow:
    key: str
    claim: str
    statistic: str
    predicted: str
    per_seed: list[dict[str, Any]] = field(default_factory=list)  # {seed, grpo, casp, tested}
    pooled: Interval | None = None
    over_seeds: Interval | None = None
    verdict: str = "cannot tell"
    missing: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "claim": self.claim,
            "statistic": self.statistic,
            "predicted": self.predicted,
            "per_seed": self.per_seed,
            "pooled_over_prompts": self.pooled.to_json() if self.pooled else None,
            "over_seeds": self.over_seeds.to_json() if self.over_seeds else None,
            "verdict": self.verdict,
            "missing": self.missing,
        }


def _final(design: Design, run: str) -> str:
    return probe_label(run, design.steps)


def _paired_claim(
    res: Results,
    spec: IntervalSpec,
    key: str,
    claim: str,
    statistic: str,
    predicted: int,
    value: Callable[[str], ms.Quantity | None],
    tested: Callable[[dict[str, ms.Quantity]], ms.Quantity],
) -> ClaimRow:
    """A claim tested on every seed pair: ``value(run)`` is a run's quantity (e.g. its final rank-1 probability, or
    its change from the base), ``tested({arm: quantity})`` the pair's tested quantity (e.g. CaSP - GRPO). Pooled:
    the mean over pairs, resampled on the same prompts; over seeds: the t-interval of the per-pair values."""
    row = ClaimRow(key, claim, statistic, "> 0" if predicted > 0 else "< 0")
    everything = np.arange(res.prompts)
    tested_q = []
    for seed, names in res.design.paired_runs():
        values = {arm: value(name) for arm, name in names.items()}
        absent = [names[a] for a, v in values.items() if v is None]
        if absent:
            row.missing += absent
            continue
        t = tested(values)  # type: ignore[arg-type]
        tested_q.append(t)
        row.per_seed.append(
            {"seed": seed, **{arm: values[arm](everything) for arm in PAIRED_ARMS}, "tested": t(everything)}  # type: ignore[misc]
        )
    if tested_q:
        row.pooled = ms.prompt_interval(ms.mean_of(tested_q), res.prompts, spec, key)
        row.over_seeds = ms.seed_interval([p["tested"] for p in row.per_seed], spec.level)
        seeds = row.over_seeds if len(tested_q) > 1 else None
        row.verdict = ms.verdict(predicted, row.pooled, seeds) + ("" if seeds else " (one seed pair)")
        if row.missing:
            row.verdict = "cannot tell (runs missing)"
    return row


def claims(res: Results, spec: IntervalSpec = IntervalSpec()) -> list[ClaimRow]:
    d = res.design
    k = d.ks[0]

    def final(scope: str, name: str) -> Callable[[str], ms.Quantity | None]:
        return lambda run: res.quantity(_final(d, run), scope, name)

    def change(scope: str, name: str) -> Callable[[str], ms.Quantity | None]:
        def at(run: str) -> ms.Quantity | None:
            end, base = res.quantity(_final(d, run), scope, name), res.quantity(BASE, scope, name)
            return ms.difference(end, base) if end and base else None

        return at

    def grpo(values: dict[str, ms.Quantity]) -> ms.Quantity:
        return values["grpo"]

    def casp_minus_grpo(values: dict[str, ms.Quantity]) -> ms.Quantity:
        return ms.difference(values["casp"], values["grpo"])

    rows = [
        _paired_claim(
            res,
            spec,
            "B1-gap",
            "plain RLVR widens the rank-1 gap (sec. 3.1, app. B.1, Fig. 3)",
            "GRPO: rank-1 minus rank-2, final - base, all positions",
            +1,
            change("all", "gap"),
            grpo,
        ),
        _paired_claim(
            res,
            spec,
            "B1-gap-forking",
            "the same at the forking tokens",
            "GRPO: rank-1 minus rank-2, final - base, forking positions",
            +1,
            change("forking", "gap"),
            grpo,
        ),
        _paired_claim(
            res,
            spec,
            "B2-distinct",
            "as rank 1 goes to 1, E[distinct tokens in K draws] goes to 1 (app. B.2)",
            f"GRPO: E[distinct in {k} draws], final - base, all positions",
            -1,
            change("all", f"distinct@{k}"),
            grpo,
        ),
        _paired_claim(
            res,
            spec,
            "F7-rank1",
            "CaSP concentrates less than GRPO (Fig. 7)",
            "rank-1 probability at the final step, CaSP - GRPO, all positions",
            -1,
            final("all", "rank1"),
            casp_minus_grpo,
        ),
        _paired_claim(
            res,
            spec,
            "F7-rank23",
            "CaSP keeps mass on the rank-2/3 candidates",
            "rank-2 + rank-3 probability, final, CaSP - GRPO, all positions",
            +1,
            final("all", "rank23"),
            casp_minus_grpo,
        ),
        _paired_claim(
            res,
            spec,
            "F7-distinct",
            "CaSP keeps more distinct candidates",
            f"E[distinct in {k} draws], final, CaSP - GRPO, all positions",
            +1,
            final("all", f"distinct@{k}"),
            casp_minus_grpo,
        ),
        _paired_claim(
            res,
            spec,
            "F8-entropy",
            "CaSP keeps entropy at forking tokens (Fig. 8)",
            "entropy at the base's forking positions, final, CaSP - GRPO",
            +1,
            final("forking", "entropy"),
            casp_minus_grpo,
        ),
        _paired_claim(
            res,
            spec,
            "AoE-rare",
            "RLVR takes probability from the base's rare correct answers",
            "GRPO: log-prob per token of the rare correct answers, final - base",
            -1,
            change("all", RARE),
            grpo,
        ),
        _paired_claim(
            res,
            spec,
            "AoE-rare-casp",
            "CaSP keeps more of it than GRPO",
            "log-prob per token of the rare correct answers, final, CaSP - GRPO",
            +1,
            final("all", RARE),
            casp_minus_grpo,
        ),
    ]
    rows.append(_near_zero(res, spec))
    rows.append(_rank3_share(res, spec))
    rows.append(_psr_nsr(res, spec))
    return rows


def _near_zero(res: Results, spec: IntervalSpec) -> ClaimRow:
    """GRPO drives forking entropy near zero: final / base forking entropy, pooled over GRPO seeds, below 0.1."""
    d = res.design
    row = ClaimRow(
        "F8-near-zero",
        "GRPO drives the forking tokens' entropy near zero (Fig. 8)",
        f"GRPO: forking entropy final / base (near zero: < {FORK_ENTROPY_NEAR_ZERO})",
        f"< {FORK_ENTROPY_NEAR_ZERO}",
    )
    base = res.quantity(BASE, "forking", "entropy")
    ratios = []
    for seed, names in d.paired_runs():
        end = res.quantity(_final(d, names["grpo"]), "forking", "entropy")
        if end is None or base is None:
            row.missing.append(names["grpo"])
            continue
        ratios.append(lambda idx, end=end: end(idx) / base(idx))
        row.per_seed.append({"seed": seed, "grpo": ratios[-1](np.arange(res.prompts))})
    if ratios:
        row.pooled = ms.prompt_interval(ms.mean_of(ratios), res.prompts, spec, row.key)
        row.over_seeds = ms.seed_interval([p["grpo"] for p in row.per_seed], spec.level)
        flipped = ms.threshold_verdict(row.pooled, FORK_ENTROPY_NEAR_ZERO)  # "holds" means above the threshold
        row.verdict = {"holds": "fails", "fails": "holds"}.get(flipped, flipped)
        if row.missing:  # as for the paired claims: judged on every GRPO seed or not at all
            row.verdict = "cannot tell (runs missing)"
    return row


def _rank3_share(res: Results, spec: IntervalSpec) -> ClaimRow:
    row = ClaimRow(
        "D2-rank3",
        "the rank-3 candidate is below 0.05 in more than 95% of cases (app. D.2)",
        "base: share of positions with rank-3 probability < 0.05, all positions",
        "> 0.95",
    )
    q = res.quantity(BASE, "all", "rank3_below")
    if q is None:
        row.missing.append(BASE)
        return row
    row.pooled = ms.prompt_interval(q, res.prompts, spec, row.key)
    forking = res.quantity(BASE, "forking", "rank3_below")
    row.per_seed.append({"seed": "base", "forking positions": forking(np.arange(res.prompts)) if forking else None})
    row.verdict = ms.threshold_verdict(row.pooled, 0.95)
    return row


def _psr_nsr(res: Results, spec: IntervalSpec) -> ClaimRow:
    d = res.design
    psr, nsr = run_name("psr", d.single_seed), run_name("nsr", d.single_seed)
    row = ClaimRow(
        "F3-order",
        "PSR widens the rank-1 gap, NSR slows its widening (Fig. 3)",
        f"rank-1 minus rank-2 at the final step, PSR - NSR (seed {d.single_seed}), all positions",
        "> 0",
    )
    a, b = res.quantity(_final(d, psr), "all", "gap"), res.quantity(_final(d, nsr), "all", "gap")
    base = res.quantity(BASE, "all", "gap")
    grpo = res.quantity(_final(d, run_name("grpo", d.single_seed)), "all", "gap")
    if a is None or b is None or base is None:
        row.missing += [r for r, q in ((psr, a), (nsr, b), (BASE, base)) if q is None]
        return row
    everything = np.arange(res.prompts)
    row.per_seed.append(
        {
            "seed": d.single_seed,
            "psr change": a(everything) - base(everything),
            "grpo change": grpo(everything) - base(everything) if grpo else None,
            "nsr change": b(everything) - base(everything),
        }
    )
    row.pooled = ms.prompt_interval(ms.difference(a, b), res.prompts, spec, row.key)
    row.verdict = ms.verdict(+1, row.pooled, None) + " (one seed)"
    return row


# --- rendering --------------------------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:+.{digits}f}"


def _per_seed_cell(p: dict[str, Any]) -> str:
    """``s1: GRPO / CaSP: tested`` for a seed pair; other rows (PSR / NSR, the base) name their values."""
    values = {k: v for k, v in p.items() if k not in ("seed", "tested")}
    if set(values) <= set(PAIRED_ARMS):
        cell = " / ".join(_fmt(v) for v in values.values())
    else:
        cell = ", ".join(f"{k} {_fmt(v)}" for k, v in values.items())
    head = f"s{p['seed']}" if isinstance(p["seed"], int) else str(p["seed"])
    return f"{head}: {cell}" + (f": {_fmt(p['tested'])}" if "tested" in p else "")


def claims_markdown(rows: list[ClaimRow]) -> str:
    lines = [
        "| claim | tested statistic | predicted | per seed pair (GRPO / CaSP: tested) | pooled [95% over prompts] "
        "| over seeds [95% t] | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seeds = "; ".join(_per_seed_cell(p) for p in r.per_seed)
        missing = f" (missing: {', '.join(r.missing)})" if r.missing else ""
        lines.append(
            f"| {r.claim} | {r.statistic} | {r.predicted} | {seeds or '-'}{missing} | {ms.interval_text(r.pooled)} | "
            f"{ms.interval_text(r.over_seeds)} | **{r.verdict}** |"
        )
    return "\n".join(lines) + "\n"


def write_report(
    results_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, spec: IntervalSpec = IntervalSpec()
) -> list[Path]:
    from megatron_rlvr.inspection.mechanism_figures import distinct_figure, passk_figure, steps_figure

    res = Results.load(results_dir)
    out = Path(out_dir) if out_dir else res.root / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = claims(res, spec) if res.probe else []
    table = passk(res, spec) if res.evals else {}
    text = [
        "# CaSP mechanism study: results\n",
        f"Design: `{json.dumps(res.design.to_json())}`\n",
        "## Claims (docs/casp-mechanism.md)\n",
        claims_markdown(rows),
        "## pass@k\n",
        passk_markdown(table),
    ]
    paths = [out / "report.md", out / "report.json"]
    paths[0].write_text("\n".join(text))
    paths[1].write_text(json.dumps({"claims": [r.to_json() for r in rows], "passk": table}, indent=1, default=float))
    if res.probe:
        paths.append(steps_figure(res, out / "probe_over_steps.png"))
        paths.append(distinct_figure(res, out / "distinct_by_rank1.png"))
    if table:
        paths.append(passk_figure(res, table, out / "passk.png"))
    return paths
