"""A resumed run equals an uninterrupted one (tests/integration/resume_table.py), the colocated loop's rows: plain, preempted
(SIGTERM mid-step: the stop's checkpoint), dynamic sampling's refill, ARMOR's anchors. Besides the equalities, what
each reference and interruption must show: the stop wrote one verified checkpoint and no final export, a step's
checkpoint converts to the run's own HF export, the refill and anchor steps compared did refill and find anchors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.resume_table import Runs, assert_resumed_equals_uninterrupted
from tests.integration.training_runs import make_tiny_model

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(workers2, tmp_path_factory):
    return Runs(workers2, make_tiny_model(tmp_path_factory.mktemp("qwen")), tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("scenario", ["plain", "preempted", "refill", "armor"])
def test_a_resumed_run_repeats_the_uninterrupted_metrics(runs, scenario):
    assert_resumed_equals_uninterrupted(runs, scenario)


def test_a_signalled_run_finishes_its_step_and_writes_one_checkpoint(runs):
    stop = runs.resumed("preempted").stop
    assert [[m["step"] for m in h] for h in stop.histories] == [[1, 2], [1, 2]]  # every rank finished step 2
    assert stop.checkpoints == ["latest", "step-000002"] and stop.verified  # save_every 0: the stop's checkpoint
    assert not stop.exported  # the final HF export waits for the real end


def test_a_step_checkpoint_exports_like_the_final_model(runs):
    """A trainer checkpoint converts to HF with tools/convert.py, equal to the run's own HF export."""
    import torch
    from safetensors.torch import load_file

    runs.reference("plain")
    run = runs.reference_dir("plain")
    out = run.parent / "plain-step4-hf"
    subprocess.run(
        [sys.executable, "tools/convert.py", "mcore-to-hf", "--mcore-dir", str(run / "checkpoints" / "step-000004"),
         "--out", str(out)],
        check=True,
        cwd=ROOT,
        timeout=600,
    )  # fmt: skip
    ours, theirs = load_file(run / "hf" / "model.safetensors"), {}
    for f in out.glob("*.safetensors"):
        theirs.update(load_file(f))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_refill_steps_compared_did_refill(runs):
    full = runs.reference("refill")[0]
    assert sum(m["batch/refill_rounds"] for m in full[2:]) > 0
    assert all(m["batch/groups_trained"] > 0 for m in full)


def test_armor_resets_every_two_steps_and_the_policy_leaves_the_reference(runs):
    full = runs.reference("armor")[0]
    assert [m["anchor/reset"] for m in full] == [1.0, 0.0, 1.0, 0.0]
    assert full[3]["anchor/groups_trained"] > 0 and full[3]["loss/kl_ref"] > 0
