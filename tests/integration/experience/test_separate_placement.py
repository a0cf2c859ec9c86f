"""Separate placement (engines on ranks of their own) and one-step-off training: the cross-section checks of the
config; the demo recipe trains end to end on 2 processes (actor TP=1, one engine rank) with rollout.max_staleness=1 and
logs the staleness; killing the engine rank mid-run stops the whole run with a non-zero exit within a timeout,
naming the rank, and leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.errors import ConfigError
from tests.support.experience.demo_training import logged_metrics, start_demo_training

ROOT = Path(__file__).resolve().parents[3]
SEPARATE = ["rollout.placement=separate", "rollout.engine_ranks=1", "actor.tp=1"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["rollout.max_staleness=1"], 2, "rollout.max_staleness=1 needs rollout.placement=separate"),
        (["rollout.max_staleness=2", "rollout.prefix_model=x", *SEPARATE], 2, "outer prefixes are not streamed"),
        (["rollout.max_staleness=2", "actor.router_replay=rollout", *SEPARATE], 2, "set actor.router_replay=train"),
        (["rollout.placement=separate", "rollout.engine_ranks=2", "actor.tp=1"], 2, "less than the world size 2"),
        (["rollout.placement=separate", "rollout.engine_ranks=1", "actor.tp=2"], 2, "must divide the actor's ranks"),
        (["rollout.placement=separate", "rollout.engine_ranks=3", "rollout.tp=2", "actor.tp=1"], 8, "multiple of"),
    ],
)
def test_placement_checks_name_the_key(overrides, world, message):
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate(world)


def test_separate_layouts_that_fit_pass_and_one_step_off_warns_without_correction():
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", [*SEPARATE, "rollout.max_staleness=1"])
    cfg.validate(2)
    assert any("algo.rollout_correction.kind" in w for w in cfg.warnings())
    corrected = load_config(
        ROOT / "configs" / "demo_cpu.yaml", [*SEPARATE, "rollout.max_staleness=1", "algo.rollout_correction.kind=tis"]
    )
    assert corrected.validate(2).warnings() == []
    # 4 actor ranks at TP=2 beside 4 engine ranks at engine TP=2
    load_config(None, ["rollout.placement=separate", "rollout.engine_ranks=4", "rollout.tp=2", "actor.tp=2"]).validate(
        8
    )


def start_torchrun(out: Path, steps: int, extra: list[str] = ()) -> subprocess.Popen:  # noqa: B006
    """The demo one-step-off on an engine rank, 8 prompts a step."""
    overrides = ["trainer.prompts_per_step=8", *SEPARATE, "rollout.max_staleness=1", *extra]
    return start_demo_training(out, steps, overrides, out.with_suffix(".log"))


@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.slow
def test_demo_trains_one_step_off_on_an_engine_rank(tmp_path):
    out = tmp_path / "run"
    proc = start_torchrun(out, 4, ["algo.rollout_correction.kind=tis"])
    try:
        assert proc.wait(timeout=900) == 0, out.with_suffix(".log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = logged_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 1 samples with the initial weights; every later step with the weights one update older
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["transfer/bytes"] > 0 for r in rows[:3]) and all(r["response/tokens_trained"] > 0 for r in rows)
    assert rows[0]["rollout/logp_mismatch"] < 1e-4 < rows[1]["rollout/logp_mismatch"]  # fresh vs one update stale
    assert all(r["rollout_correction/weight_mean"] > 0 for r in rows)


@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.slow
def test_pba_outer_prefixes_and_validation_compose_with_engine_ranks(tmp_path):
    out = tmp_path / "run"
    proc = start_torchrun(
        out,
        2,
        [
            "algo.kl.pba.enabled=true",
            "algo.kl.pba.base_samples=2",
            "algo.kl.coef=0",
            "rollout.prefix_model=megatron_rlvr/demo/weak_model",
            "rollout.prefix_fraction=0.25",
            "trainer.eval_every=2",
            "algo.rollout_correction.kind=tis",
        ],
    )
    try:
        assert proc.wait(timeout=900) == 0, out.with_suffix(".log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the base's evidence came from the engine ranks before the first update: every training prompt, M = 2 each
    counts = json.loads((out / "base_evidence.json").read_text())["counts"]
    assert len(counts) > 100 and set(counts.values()) <= {0, 1, 2} and sum(counts.values()) > 0
    rows = logged_metrics(out)
    assert [r["step"] for r in rows if "loss/pg_loss" in r] == [1, 2]
    trained = [r for r in rows if "loss/pg_loss" in r]
    assert all(0 < r["pba/anchored_frac"] <= 1 for r in trained)
    assert all(r["rollout/prefix_frac"] == pytest.approx(0.25) for r in trained)  # 2 of each group of 8
    assert [r["step"] for r in rows if "val/pass@1" in r] == [0, 2]  # validation through the engine ranks


@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.slow
def test_a_killed_engine_rank_stops_the_run_within_the_timeout(tmp_path):
    import psutil

    out = tmp_path / "run"
    proc = start_torchrun(out, 200)
    try:
        deadline = time.monotonic() + 600
        while not logged_metrics(out):
            assert proc.poll() is None, out.with_suffix(".log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step was logged within 600 s"
            time.sleep(0.5)
        launcher = psutil.Process(proc.pid)
        family = launcher.children(recursive=True)
        engine = next(
            p for p in family if p.environ().get("RANK") == "1" and "torch.distributed.run" not in " ".join(p.cmdline())
        )
        engine.kill()
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = out.with_suffix(".log").read_text()
    print(f"exit {code} {took:.1f} s after the engine rank was killed")
    assert code != 0
    assert "rank: 1" in log or "engine rank" in log  # torchrun's failure summary names the rank (or the actor did)
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
