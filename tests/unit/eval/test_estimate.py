"""The cost estimate: calibration on the first request (kept), recorded figures, the K = 1024 recipe, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.eval.api import estimate, evaluate
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.estimate import (
    EstimateError,
    JobEstimate,
    ModelEstimate,
    Throughput,
    append_timing,
    format_estimate,
    halfwidth_bound,
    read_timing,
    recipe_estimate,
)
from megatron_rlvr.eval.store import load_records
from megatron_rlvr.recipes.estimate import main as estimate_main
from megatron_rlvr.rewards import RewardConfig
from tests.support.eval.fake_engine import FakeEngine, encode, write_data

REPO = Path(__file__).resolve().parents[3]
K1024 = REPO / "configs" / "eval_k1024_qwen2.5-math-7b.yaml"


def test_recorded_timing_sums_sessions_and_skips_cut_and_empty_lines(tmp_path):
    assert read_timing(tmp_path) is None
    append_timing(tmp_path, {"samples": 100, "tokens": 800, "seconds": 10.0, "startup_seconds": 3.0})
    append_timing(tmp_path, {"samples": 0, "tokens": 0, "seconds": 0.1, "startup_seconds": 9.0})
    append_timing(tmp_path, {"samples": 300, "tokens": 3200, "seconds": 30.0, "startup_seconds": 2.0})
    with open(tmp_path / "timing.jsonl", "a") as f:
        f.write('{"samples": 5')  # a session killed mid-line
    t = read_timing(tmp_path)
    assert (t.samples, t.tokens, t.seconds, t.startup_seconds) == (400, 4000, 40.0, 2.0)
    assert t.seconds_per_sample == 0.1 and t.tokens_per_sample == 10.0 and t.tokens_per_second == 100.0


def test_wall_time_and_gpu_hours_arithmetic():
    figures = Throughput(samples=1000, tokens=500_000, seconds=10.0, startup_seconds=20.0, source="test")
    model = ModelEstimate("m", samples_total=102_400, samples_to_draw=101_400, max_new_tokens=3072, throughput=figures)
    assert model.wall_seconds == pytest.approx(20.0 + 102_400 * 0.01)
    assert model.remaining_seconds == pytest.approx(20.0 + 101_400 * 0.01)
    assert model.tokens_expected == pytest.approx(102_400 * 500) and model.tokens_bound == 102_400 * 3072
    job = JobEstimate({"aime24": 100}, 1024, [model, model], gpus=4, overhead_seconds=6.0)
    assert job.wall_seconds == pytest.approx(6.0 + 2 * model.wall_seconds)
    assert job.gpu_hours == pytest.approx(job.wall_seconds * 4 / 3600)
    assert JobEstimate({"x": 1}, 1, [model], gpus=0).gpu_hours is None  # CPU: no GPU-hours
    given = ModelEstimate("m", 1000, 1000, 100, tokens_per_second=1e4)  # a user's throughput: every sample at the cap
    assert given.wall_seconds == pytest.approx(10.0) and given.tokens_expected is None
    assert halfwidth_bound(30) == pytest.approx(1.959964 * 0.5 / 30**0.5, rel=1e-6)


def test_the_k1024_recipe_prints_its_estimate_and_interval_columns(capsys):
    cfg = load_config(K1024)
    job = recipe_estimate(cfg)  # /data/eval is not on this machine: the published sizes, said in a note
    assert (
        job.benchmarks == {"aime24": 30, "aime25": 30, "amc23": 40}
        and job.n == 1024
        and job.gpus == cfg.rollout.tp == 4
    )
    (model,) = job.models
    assert model.samples_total == 102_400 and model.tokens_bound == 102_400 * 3072 and job.wall_seconds is None
    assert estimate_main([str(K1024)]) == 0
    text = capsys.readouterr().out
    assert "| aime24 | 30 | 1024 | 30,720 | +-17.9 points |" in text
    assert "| amc23 | 40 | 1024 | 40,960 | +-15.5 points |" in text and "314,572,800" in text
    assert "| benchmark | model | problems | n | pass@1 [95%] |" in text and "| pass@1024 [95%] |" in text
    assert "published size" in text
    assert estimate_main([str(K1024), "--tokens-per-second", "20000"]) == 0
    text = capsys.readouterr().out
    hours = 102_400 * 3072 / 20000 / 3600
    assert f"{hours * 4:,.1f} GPU-hours" in text and "upper bound" in text


def _fake_cfg(root: Path) -> EvalConfig:
    write_data(root / "data")
    return EvalConfig(
        n_samples=16,
        chunk=8,
        benchmarks=["math500", "countdown"],
        data_dir=str(root / "data"),
        output_dir=str(root / "out"),
    )


def test_calibration_draws_and_keeps_the_first_request_then_recorded_figures_need_no_engine(tmp_path):
    cfg = _fake_cfg(tmp_path)
    engines = []

    def factory(model, c):
        engines.append(FakeEngine(0.5))
        return engines[-1]

    model = str(tmp_path / "models" / "m")
    job = estimate([model], cfg, RewardConfig(workers=1), factory, lambda m, c: encode)
    (m,) = job.models
    # math500's 3 problems x chunk 0 (8 samples) is the first request: 24 of 5 x 16 samples drawn and kept
    assert engines[0].calls == 1 and len(load_records(tmp_path / "out" / "m")) == 24
    assert (m.samples_total, m.samples_to_draw) == (80, 56) and m.throughput.samples == 24
    assert m.throughput.source.startswith("calibration") and job.gpus == 0 and job.wall_seconds > 0
    assert "whole job:" in format_estimate(job)
    # the real run draws only what the calibration left: 3 more requests
    evaluate([model], cfg, RewardConfig(workers=1), factory, lambda m, c: encode)
    assert engines[1].calls == 3 and len(load_records(tmp_path / "out" / "m")) == 80

    def no_engine(model, c):
        raise AssertionError("recorded figures need no engine")

    again = estimate([model], cfg, RewardConfig(workers=1), no_engine, lambda m, c: encode)
    assert again.models[0].throughput.source.startswith("recorded") and again.models[0].samples_to_draw == 0
    assert again.models[0].throughput.samples == 80  # both sessions
    # a finished directory re-tabulated starts no engine either
    evaluate([model], cfg, RewardConfig(workers=1), no_engine, lambda m, c: encode)


def test_recorded_figures_of_other_settings_are_refused_naming_the_field(tmp_path):
    cfg = load_config(K1024)
    run = tmp_path / "run"
    run.mkdir()
    append_timing(run, {"samples": 10, "tokens": 100, "seconds": 1.0})
    (run / "run.json").write_text(json.dumps({"model": str(Path(cfg.model.hf_dir).resolve()), "temperature": 1.0}))
    with pytest.raises(EstimateError, match=r"differs in temperature \(recorded 1.0, this job 0.6\)"):
        recipe_estimate(cfg, recorded=str(run))
    with pytest.raises(EstimateError, match="no timing.jsonl with drawn samples"):
        recipe_estimate(cfg, recorded=str(tmp_path))
