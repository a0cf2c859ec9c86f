"""The demo report: pass@k table for base vs trained, distinct correct answers, plots, results.json, bad input."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.demo.report import answer_key, k_values, per_prompt, write_report
from megatron_rlvr.monitor import MetricLogger


def _samples(correct_per_prompt: dict[str, list[str]], n: int = 8):
    """n samples per prompt: the given correct answers first, then wrong ones."""
    rows = []
    for pid, answers in correct_per_prompt.items():
        for i in range(n):
            ok = i < len(answers)
            rows.append({"prompt_id": pid, "sample": i, "response": answers[i] if ok else "1+1", "reward": float(ok)})
    return rows


def test_per_prompt_counts_correct_and_distinct_answers():
    stats = per_prompt(_samples({"a": ["3*7+4", "3 * 7 + 4\nextra", "4+3*7"], "b": []}, n=4))
    assert stats["a"] == {"n": 4, "correct": 3, "distinct_correct": 2, "distinct": 3}
    assert stats["b"] == {"n": 4, "correct": 0, "distinct_correct": 0, "distinct": 1}
    assert answer_key(" 3 * 7+4 \nmore") == "3*7+4"


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match=r"base\[1\]: missing reward"):
        per_prompt(
            [
                {"prompt_id": "a", "sample": 0, "response": "", "reward": 0},
                {"prompt_id": "a", "sample": 1, "response": ""},
            ],
            "base",
        )


def test_k_values_are_powers_of_two_up_to_n():
    assert k_values(64) == [1, 2, 4, 8, 16, 32, 64]
    assert k_values(6) == [1, 2, 4, 6]


def test_report_folder_has_the_table_the_plots_and_results(tmp_path):
    run = tmp_path / "run"
    with MetricLogger(run, tensorboard=False) as log:
        for s in range(1, 4):
            log.log(
                s,
                {
                    "reward/mean": 0.1 * s,
                    "policy/rank1_prob": 0.7,
                    "policy/rank2_prob": 0.2,
                    "policy/rank3_prob": 0.05,
                    "policy/entropy": 0.9,
                },
            )
        log.log_histogram(3, "eval/entropy", [0.1, 0.5, 1.2, 0.3])
        log.log(3, {"val/pass@1": 0.25, "val/pass@2": 0.5, "val/entropy": 0.75})
    base = _samples({"p1": ["3*7+4"], "p2": [], "p3": ["1+2", "2+1"]})
    trained = _samples({"p1": ["3*7+4", "4+3*7", "7*3+4"], "p2": ["9-1"], "p3": ["1+2", "2+1"]})
    summary = write_report(
        tmp_path / "report",
        {"base": base, "trained": trained},
        metrics={"casp": run / "metrics.jsonl"},
        notes=["2 steps"],
    )
    out = tmp_path / "report"
    names = {p.name for p in summary["files"]}
    assert {
        "report.md",
        "results.json",
        "pass_at_k.png",
        "reward.png",
        "rank_probs.png",
        "entropy.png",
        "entropy_hist.png",
    } <= names
    for name in names - {"report.md", "results.json"}:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "| model | prompts | n | pass@1 [95%] | pass@2 [95%] | pass@4 [95%] | pass@8 [95%] |" in md
    # base: c = 1, 0, 2 of n = 8 -> pass@1 = mean(1/8, 0, 2/8) = 12.5 %; pass@8 = 2/3. Intervals over 3 prompts:
    # all three resampled as the lowest (or the highest) has chance 1/27 > 2.5%, so the ends are the extremes
    assert "| base | 3 | 8 | 12.5 [0.0, 25.0] |" in md
    assert md.split("| base | 3 |")[1].split("\n")[0].rstrip().endswith("66.7 [0.0, 100.0] |")
    assert "| trained | 3 | 8 | 25.0 [" in md
    # against the base: trained solves p2, base does not (1 vs 0 discordant: sign test p = 1)
    assert "## Against base" in md and md.split("| trained | +12.5 [")[1].split("\n")[0].endswith("| 1 | 0 | 1 |")
    assert "![pass_at_k](pass_at_k.png)" in md
    # solved at least once: base p1, p3; trained p1, p2, p3 -> one gained, none lost
    assert "| base | 2 | 3 | 0 | 0 |" in md and "| trained | 3 | 3 | 1 | 0 |" in md
    assert "| step | pass@1 | pass@2 | entropy |" in md and "| 3 | 25.0 | 50.0 | 0.750 |" in md
    results = json.loads((out / "results.json").read_text())
    assert results["models"]["trained"]["mean_distinct_correct"] == pytest.approx(2.0)
    assert results["models"]["base"]["pass_at_k_interval"]["1"] == pytest.approx(
        {"estimate": 0.125, "low": 0.0, "high": 0.25}
    )
    assert results["per_prompt"]["base"]["p1"]["n"] == 8 and results["per_prompt"]["base"]["p1"]["correct"] == 1
    assert results["paired"]["trained"]["sign_test_p"] == 1.0
    assert results["per_prompt"]["base"]["p3"]["distinct_correct"] == 2


def test_report_without_training_metrics_still_has_table_and_pass_at_k_plot(tmp_path):
    summary = write_report(tmp_path, {"base": _samples({"p": ["1+2"]}, n=4)})
    assert sorted(p.name for p in summary["files"]) == ["pass_at_k.png", "report.md", "results.json"]
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        write_report(tmp_path, {"base": _samples({"p": []})}, metrics=tmp_path / "nope.jsonl")


def test_prompts_solved_counts_gains_and_losses_against_the_first_model(tmp_path):
    base = _samples({"p1": ["1+2"], "p2": ["3+4"], "p3": []}, n=4)
    trained = _samples({"p1": ["1+2", "2+1"], "p2": [], "p3": ["5+6"]}, n=4)
    write_report(tmp_path, {"base": base, "trained": trained})
    md = (tmp_path / "report.md").read_text()
    assert "| base | 2 | 3 | 0 | 0 |" in md and "| trained | 2 | 3 | 1 | 1 |" in md


def test_off_policy_and_dynamic_sampling_metrics_get_their_panels(tmp_path):
    from megatron_rlvr.monitor import plots

    run = tmp_path / "run"
    with MetricLogger(run, tensorboard=False) as log:
        for s in range(1, 4):
            log.log(
                s,
                {
                    "reward/mean": 0.1 * s,
                    "rollout_correction/weight_mean": 0.99,
                    "rollout_correction/clipped_frac": 0.01 * s,
                    "batch/groups_trained": 16 - s,
                    "batch/refill_rounds": s % 2,
                    "response/truncated_frac": 0.0,
                },
            )
    summary = write_report(
        tmp_path / "report", {"base": _samples({"p": ["1+2"]}, n=4)}, metrics={"tis": run / "metrics.jsonl"}
    )
    assert (tmp_path / "report" / "off_policy.png").read_bytes()[:4] == b"\x89PNG"
    assert "off_policy.png" in {p.name for p in summary["files"]}
    assert "![off_policy](off_policy.png)" in (tmp_path / "report" / "report.md").read_text()
    # a run that logged none of the keys gets no figure
    assert (
        plots.plot_metric_panels(
            {"x": [{"step": 1, "reward/mean": 1.0}]}, ("batch/refill_rounds",), tmp_path / "none.png"
        )
        is None
    )
    assert not (tmp_path / "none.png").exists()
