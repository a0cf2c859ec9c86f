"""LoRA with engines on ranks of their own and one-step-off training (actor.lora.sync=adapters): the demo trains
with the adapter alone sent over the transfer and served by the engine rank's vLLM LoRA; the first step samples with
the initial adapter (B = 0: the base), whose log-probs equal the actor's, and each later step with the adapter one
update older; each transfer carries the adapter, not the model."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.experience.test_separate_placement import start_torchrun
from tests.support.experience.demo_training import logged_metrics

LORA = ["actor.lora.rank=4", "actor.lora.alpha=32", "actor.lora.sync=adapters", "actor.lr=1e-3"]


@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.slow
def test_lora_adapters_train_one_step_off_on_an_engine_rank(tmp_path):
    out = tmp_path / "run"
    proc = start_torchrun(out, 3, [*LORA, "algo.rollout_correction.kind=tis"])
    try:
        assert proc.wait(timeout=900) == 0, out.with_suffix(".log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rows = logged_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    sent = [r["transfer/bytes"] for r in rows[:2]]
    assert all(0 < b < 200_000 for b in sent), sent  # the rank-4 adapter (~100 kB), not the 1.8 MB model
    assert rows[0]["rollout/logp_mismatch"] < 1e-4 < rows[1]["rollout/logp_mismatch"]
    assert all(r["response/tokens_trained"] > 0 for r in rows)
