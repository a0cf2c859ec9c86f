"""Fully asynchronous training end to end on 2 processes (actor TP=1, one engine rank; ``rollout.max_staleness=2``),
with the demo recipe's answers made long-tailed (megatron_rlvr/testing/long_tail: log-normal lengths, median 8
tokens) so that responses are in flight at every weight update. Each run checks the bound on every step, that
nothing was dropped and that responses of two weight versions were trained. Preemption: SIGTERM checkpoints the
stream (finished groups and every response in flight) and exits 0, and the rerun continues those responses; kill -9
resumes from the last periodic checkpoint. What holds is docs/async.md's guarantee, not the uninterrupted run's
metrics (timing decides which version samples which token)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.experience.demo_training import logged_metrics, start_demo_training

ROOT = Path(__file__).resolve().parents[3]
HOOK = ROOT / "megatron_rlvr" / "testing" / "long_tail"
K = 2
STEPS = 8

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]


def _torchrun(out: Path, steps: int, extra: list[str] = (), log_name: str = "run") -> subprocess.Popen:  # noqa: B006
    """The demo fully asynchronous (max_staleness K) on an engine rank, 4 prompts a step, with a forced slow engine."""
    overrides = [
        "trainer.prompts_per_step=4",
        "rollout.placement=separate",
        "rollout.engine_ranks=1",
        "actor.tp=1",
        f"rollout.max_staleness={K}",
        "rollout.max_new_tokens=96",
        "algo.rollout_correction.kind=tis",
        *extra,
    ]
    env = {
        "PYTHONPATH": f"{HOOK}:{ROOT}",
        "MEGATRON_RLVR_LONG_TAIL": "40,0.6,0.05",  # a forced slow engine: updates land mid-response
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600",
    }
    return start_demo_training(out, steps, overrides, out.parent / f"{log_name}.log", env)


def _finish(proc: subprocess.Popen, out: Path, log_name: str = "run", timeout: float = 1200) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        print((out.parent / f"{log_name}.log").read_text()[-2000:])


def _wait_for_steps(proc: subprocess.Popen, out: Path, count: int) -> None:
    deadline = time.monotonic() + 900
    while len(logged_metrics(out)) < count:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, f"fewer than {count} steps logged within 900 s"
        time.sleep(0.2)


def _ranks(proc: subprocess.Popen):
    import psutil

    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "RANK" in p.environ()]


def _check_steps(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/staleness_max"] <= K and r["async/dropped"] == 0, r
        assert r["response/tokens_trained"] > 0


def test_kill9_resumes_from_the_last_periodic_checkpoint_and_a_sigterm_checkpoint_continues_its_responses(tmp_path):
    """One run of 8 steps with a checkpoint every 2, killed with -9 after step 3 (resumed from step 2's checkpoint),
    then stopped by SIGTERM after step 4 and resumed again: the bound on every step, every step logged once,
    responses of two weight versions, the weights sent after every step but the last, and the stream's checkpoint
    continued. (One scenario for both interruptions: each alone trained and started the run twice.) 8 steps: the
    stop's in-flight groups are due up to K + 1 steps after it, and each must train for the count to close."""
    import torch

    out = tmp_path / "run"
    every = ["checkpoint.save_every=2"]
    proc = _torchrun(out, STEPS, every)
    _wait_for_steps(proc, out, 3)
    ranks = _ranks(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    for rank in ranks:
        rank.kill()
    proc.wait(timeout=60)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"

    proc = _torchrun(out, STEPS, every, "rerun")
    _wait_for_steps(proc, out, 4)  # the rerun first cuts the log back to step 2: 3 rows never read as 4
    for rank in _ranks(proc):
        rank.send_signal(signal.SIGTERM)
    assert _finish(proc, out, "rerun") == 0
    assert f"resuming from {out / 'checkpoints' / 'step-000002'}" in (tmp_path / "rerun.log").read_text()
    stopped = len(logged_metrics(out))
    assert stopped + K + 1 <= STEPS, f"stopped after step {stopped}: its in-flight groups are due after the last step"
    ckpt = out / "checkpoints" / f"step-{stopped:06d}"
    state = torch.load(ckpt / "pending_rollout.pt", weights_only=False)
    partial = sum(len(r.token_ids) > 0 and not r.finish_reason for f in state.in_flight for r in f.responses)
    print(f"stopped after step {stopped}: {len(state.in_flight)} groups in flight, {partial} partial responses")
    # the weights of step `stopped` asked for its experience: it shipped before the snapshot and the checkpoint keeps
    # it, so the ledger's next step is the one after
    assert state.taken.step == stopped and state.next_step == stopped + 1 and state.version == stopped and partial > 0

    assert _finish(_torchrun(out, STEPS, every, "rerun2"), out, "rerun2") == 0
    assert f"resuming from {ckpt}" in (tmp_path / "rerun2.log").read_text()
    rows = logged_metrics(out)
    _check_steps(rows, STEPS)
    assert sum(r["async/resumed_responses"] for r in rows[stopped:]) == partial  # each continued, trained once
    assert rows[0]["rollout/staleness_max"] == 0 and max(r["rollout/staleness_max"] for r in rows) == K
    assert sum(r["rollout/mixed_version_frac"] for r in rows) > 0  # partial rollouts: tokens of two versions
    assert all(r["transfer/bytes"] > 0 for r in rows[:-1])
    histograms = [json.loads(line) for line in (out / "histograms.jsonl").read_text().splitlines()]
    assert [h["step"] for h in histograms if h["name"] == "rollout/staleness"] == list(range(1, STEPS + 1))
