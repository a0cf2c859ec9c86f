"""Monitoring: metrics.jsonl + TensorBoard sinks, resume truncation, candidate-dynamics series, histograms, plots."""

from __future__ import annotations

import json
import math
import sys

import pytest

from megatron_rlvr.algos.metrics import token_weighted_mean
from megatron_rlvr.monitor import MetricLogger, candidate_dynamics, histogram, plots, read_metrics


def _records(steps=4):
    return [
        {
            "step": s,
            "reward/mean": 0.2 + 0.1 * s,
            "policy/rank1_prob": 0.6 + 0.05 * s,
            "policy/rank2_prob": 0.2,
            "policy/rank3_prob": 0.1,
            "policy/entropy": 1.0 - 0.1 * s,
            "loss/entropy_high_entropy": 2.0,
            "loss/rank1_prob_high_entropy": 0.4,
        }
        for s in range(1, steps + 1)
    ]


def test_metric_logger_writes_jsonl_and_tensorboard(tmp_path):
    with MetricLogger(tmp_path, tensorboard=True) as log:
        log.log(1, {"reward/mean": 0.5, "actor/loss": float("nan"), "step": 1})
        log.log(2, {"reward/mean": 0.75, "actor/loss": 0.1})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "reward/mean": 0.5, "actor/loss": None},  # strict JSON: NaN is null
        {"step": 2, "reward/mean": 0.75, "actor/loss": 0.1},
    ]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]


def test_wandb_without_the_package_only_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed: `import wandb` fails
    with MetricLogger(tmp_path, tensorboard=False, wandb_project="demo") as log:
        log.log(1, {"x": 1.0})
    assert "wandb package is not installed" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 1.0}]


def test_resume_drops_the_steps_a_killed_run_logged_after_its_checkpoint(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        for s in range(1, 6):
            log.log(s, {"v": float(s)})
        log.log_histogram(4, "eval/entropy", [0.1, 0.2])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "v"')  # killed mid-write
    with MetricLogger(tmp_path, tensorboard=False, resume_step=3) as log:
        log.log(4, {"v": 40.0})
    assert [(r["step"], r["v"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    assert read_metrics(tmp_path / "histograms.jsonl") == []


def test_read_metrics_names_a_damaged_line(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n{oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not valid JSON"):
        read_metrics(tmp_path / "m.jsonl")


def test_token_weighted_mean_weights_micro_batches_by_tokens():
    out = token_weighted_mean([{"rank1_prob": 0.5, "num_tokens": 30}, {"rank1_prob": 0.9, "num_tokens": 10}])
    assert out == {"rank1_prob": pytest.approx(0.6), "num_tokens": 40}


def test_candidate_dynamics_reads_the_actor_and_loss_metric_names():
    dyn = candidate_dynamics(_records(3) + [{"step": 4, "reward/mean": 0.9}])
    assert dyn["rank1_prob"] == ([1, 2, 3], [pytest.approx(0.65), pytest.approx(0.7), pytest.approx(0.75)])
    assert dyn["reward"][0] == [1, 2, 3, 4]
    assert dyn["entropy_high_entropy"][1] == [2.0, 2.0, 2.0]
    assert "rank2_prob_high_entropy" not in dyn
    # bare loss-metric names (algos.metrics) are read too
    assert candidate_dynamics([{"step": 7, "rank2_prob": 0.3}])["rank2_prob"] == ([7], [0.3])


def test_the_top3_mass_is_the_sum_of_the_three_ranks_where_all_are_logged():
    records = [
        {"step": 1, "loss/rank1_prob": 0.5, "loss/rank2_prob": 0.2, "loss/rank3_prob": 0.1},
        {"step": 2, "loss/rank1_prob": 0.6, "loss/rank2_prob": 0.2},  # rank 3 missing: no mass at this step
        {"step": 3, "rank1_prob": 0.7, "rank2_prob": 0.1, "rank3_prob": 0.05, "loss/rank1_prob_high_entropy": 0.3},
    ]
    dyn = candidate_dynamics(records)
    assert dyn["top3_mass"] == ([1, 3], [pytest.approx(0.8), pytest.approx(0.85)])
    assert "top3_mass_high_entropy" not in dyn  # forking-token ranks 2 and 3 never logged


def test_histogram_counts_and_summary():
    h = histogram([0.0, 0.5, 1.0, 1.0, float("nan")], bins=2, value_range=(0.0, 1.0))
    assert h["counts"] == [1, 3] and h["edges"] == [0.0, 0.5, 1.0]
    assert h["count"] == 4 and h["nonfinite"] == 1 and h["mean"] == pytest.approx(0.625)
    assert math.isclose(h["q50"], 0.75)


def test_plots_are_written_as_png(tmp_path):
    runs = {"casp": _records(), "grpo": _records()}
    written = [
        plots.plot_reward(runs["casp"], tmp_path / "reward.png"),
        plots.plot_rank_probs(runs, tmp_path / "rank.png"),
        plots.plot_entropy(runs, tmp_path / "entropy.png"),
        plots.plot_entropy_histograms(
            [dict(histogram([0.1, 0.2, 1.5], bins=5), step=3, name="eval/entropy")], tmp_path / "hist.png"
        ),
        plots.plot_pass_at_k(
            {"base": {1: 0.2, 2: 0.35, 4: 0.5}, "trained": {1: 0.4, 2: 0.5, 4: 0.6}}, tmp_path / "passk.png"
        ),
    ]
    written.append(plots.plot_candidate_dynamics({"grpo": {"s1": _records(), "s2": _records(2)}}, tmp_path / "d.png"))
    for path in written:
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.plot_candidate_dynamics({"x": {"s": [{"step": 1}]}}, tmp_path / "none_dyn.png") is None
    assert plots.plot_entropy({"x": [{"step": 1, "reward/mean": 1.0}]}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
