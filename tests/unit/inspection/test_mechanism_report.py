"""The mechanism study's report from a synthetic results folder: the claims table gives the verdict the fixed rule
says for effects that are there, absent or reversed; missing runs are named; the pass@k table pairs CaSP with GRPO
per seed and pooled; every figure is drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rlvr.eval.bootstrap import IntervalSpec
from megatron_rlvr.inspection.mechanism_design import BASE, Design, probe_label
from megatron_rlvr.inspection.mechanism_passk import passk
from megatron_rlvr.inspection.mechanism_report import claims, write_report
from megatron_rlvr.inspection.mechanism_results import Results
from megatron_rlvr.inspection.probe_summary import SCORES_FORMAT, statistic_names

DESIGN = Design(seeds=(1, 2, 3), steps=4, probe_every=2, pass_ks=(1, 2, 4, 8), ks=(8,))
PROMPTS = 40
SPEC = IntervalSpec(resamples=200)


def _scores(label: str, levels: dict[str, float], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    counts = {scope: rng.integers(20, 60, size=PROMPTS) for scope in ("all", "forking")}
    difficulty = np.random.default_rng(99).normal(0, 0.05, size=PROMPTS)  # shared by every checkpoint
    sums = {
        scope: {
            name: ((levels.get(name, 0.3) + difficulty + rng.normal(0, 0.005, PROMPTS)) * counts[scope]).tolist()
            for name in statistic_names((8,))
        }
        for scope in counts
    }
    rare = [
        {"prompt": i, "sample": 0, "tokens": 10, "logp": 10 * (levels["rare"] + difficulty[i])}
        for i in range(0, PROMPTS, 3)
    ]
    by_rank1 = {"count": [5] * 20, "distinct@8": [5 * (8 - 7 * (b + 0.5) / 20) for b in range(20)]}
    return {"format": SCORES_FORMAT, "label": label, "checkpoint": label, "probe_set": "x", "settings": {"ks": [8]},
            "prompts": [f"p{i}" for i in range(PROMPTS)], "counts": {k: v.tolist() for k, v in counts.items()},
            "sums": sums, "rare": rare, "by_rank1": by_rank1}  # fmt: skip


def _eval(path, label: str, rate: float, seed: int) -> None:
    from megatron_rlvr.eval.bootstrap import IntervalSpec as Spec
    from megatron_rlvr.eval.results import BenchmarkCounts, results_json

    base_rate = np.random.default_rng(7).uniform(0.02, 0.3, size=PROMPTS)  # each problem's difficulty
    c = np.random.default_rng(seed).binomial(8, np.clip(base_rate + rate, 0, 1))
    counts = {"reasoning_gym": BenchmarkCounts([f"q{i}" for i in range(PROMPTS)], np.full(PROMPTS, 8), c, "d")}
    payload = results_json(label, {"temperature": 1.0, "n_samples": 8}, counts, [1, 8], Spec(resamples=20))
    path.write_text(json.dumps(payload))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    (root / "probe").mkdir()
    (root / "eval").mkdir()
    (root / "experiment.json").write_text(json.dumps({"design": DESIGN.to_json()}))
    base = {"rank1": 0.5, "gap": 0.35, "entropy": 2.0, "distinct@8": 4.0, "rank3_below": 0.40, "rare": -2.0,
            "top3": 0.70}  # fmt: skip

    def write(label, levels, seed):
        (root / "probe" / f"{label}.json").write_text(json.dumps(_scores(label, levels, seed)))

    write(BASE, base, 0)
    _eval(root / "eval" / f"{BASE}.json", BASE, 0.0, 0)
    for s in DESIGN.seeds:
        for step in (2, 4):
            f = step / 4
            # GRPO sharpens (rank 1 up, gap up, E_K down, rare answers down); CaSP less so, and keeps the forking entropy
            grpo = {**base, "rank1": 0.5 + 0.2 * f + 0.01 * s, "gap": 0.35 + 0.2 * f, "distinct@8": 4 - 1.5 * f,
                    "entropy": 2.0 - 0.8 * f, "rare": -2.0 - 0.5 * f, "top3": 0.8}  # fmt: skip
            casp = {**grpo, "rank1": grpo["rank1"] - 0.05, "entropy": 2.0 - 0.2 * f, "top3": 0.85}
            write(probe_label(f"grpo-s{s}", step), grpo, 10 * s + step)
            write(probe_label(f"casp-s{s}", step), casp, 20 * s + step)
        _eval(root / "eval" / f"grpo-s{s}.json", f"grpo-s{s}", 0.10, s)
        _eval(root / "eval" / f"casp-s{s}.json", f"casp-s{s}", 0.10, 100 + s)
    write(probe_label("psr-s1", 4), {**base, "gap": 0.6}, 5)  # NSR missing on purpose
    return root


def test_claims_give_the_verdicts_the_fixed_rule_says(folder):
    rows = {r.key: r for r in claims(Results.load(folder), SPEC)}
    assert rows["B1-gap"].verdict == "holds"  # GRPO widens the gap in every seed
    assert rows["B2-distinct"].verdict == "holds"
    assert rows["F7-rank1"].verdict == "holds"  # CaSP 0.05 below GRPO in every pair
    assert rows["F7-rank1"].pooled.estimate == pytest.approx(-0.05, abs=0.01)
    assert rows["F8-entropy"].verdict == "holds"
    assert rows["F7-rank23"].verdict == "holds"  # top-3 mass up by 0.05 and rank 1 down by 0.05 under CaSP
    assert rows["AoE-rare"].verdict == "holds"
    assert rows["AoE-rare-casp"].verdict == "cannot tell"  # no difference built in
    assert rows["F8-near-zero"].verdict == "fails"  # 1.2 / 2.0 of the base's forking entropy is far from zero
    assert rows["D2-rank3"].verdict == "fails"  # 40% of positions, not > 95%
    assert [p["seed"] for p in rows["F7-rank1"].per_seed] == [1, 2, 3]
    assert rows["F3-order"].missing == ["nsr-s1"] and rows["F3-order"].verdict == "cannot tell"


def test_a_claim_with_seeds_missing_cannot_tell_and_names_them(folder, tmp_path):
    """One seed pair done of three: the claims that need every seed say so, the threshold one on GRPO included,
    while the base's own claim is judged."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    for run in ("grpo-s2", "casp-s2", "grpo-s3", "casp-s3"):
        for path in (partial / "probe").glob(f"{run}-*.json"):
            path.unlink()
    rows = {r.key: r for r in claims(Results.load(partial), SPEC)}
    assert rows["F8-near-zero"].missing == ["grpo-s2", "grpo-s3"]
    assert rows["F8-near-zero"].verdict == "cannot tell (runs missing)"
    assert rows["F7-rank1"].verdict == "cannot tell (runs missing)"
    assert [p["seed"] for p in rows["F7-rank1"].per_seed] == [1]
    assert rows["D2-rank3"].verdict == "fails"


def test_passk_pairs_casp_with_grpo_per_seed_and_pooled(folder):
    table = passk(Results.load(folder), SPEC)["reasoning_gym"]
    assert table["ks"] == [1, 2, 4, 8]
    assert len(table["casp_minus_grpo"]["pairs"]) == 3
    pooled = table["casp_minus_grpo"]["pooled"]["1"]
    per_seed = [p["1"]["estimate"] for p in table["casp_minus_grpo"]["pairs"]]
    assert pooled["over_problems"]["estimate"] == pytest.approx(np.mean(per_seed))
    assert pooled["over_seeds"]["estimate"] == pytest.approx(np.mean(per_seed))
    assert table["vs_base"]["grpo"]["1"]["estimate"] > 0.05  # 10 points over the base built in


def test_the_report_writes_tables_and_figures(folder, tmp_path):
    paths = write_report(folder, tmp_path, SPEC)
    names = sorted(p.name for p in paths)
    assert names == ["distinct_by_rank1.png", "passk.png", "probe_over_steps.png", "report.json", "report.md"]
    text = (tmp_path / "report.md").read_text()
    assert "**holds**" in text and "**fails**" in text and "missing: nsr-s1" in text
    assert "CaSP - GRPO, pooled [over seeds, t]" in text
