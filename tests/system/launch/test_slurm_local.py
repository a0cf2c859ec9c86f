"""The launch path on a real Slurm cluster (two slurmd nodes on this machine, tools/env/slurm_cluster.sh): nemo-run ->
sbatch -> srun one task per node -> torchrun per node with c10d rendezvous -> the trainer, with gloo across the nodes.

Every scenario runs the demo recipe tiny (4 steps of 4 prompts) and checks what a cluster user would see: nemo-run's
final state, Slurm's record of each run (`sacct -D`), the metrics against an uninterrupted run, and that no process of
the job is left on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from megatron_rlvr.runtime.callbacks import ENV_VAR as CALLBACKS_ENV
from tests.system.launch.slurm_jobs import (
    REPO,
    TRAIN_OVERRIDES,
    BackgroundLaunch,
    InBackground,
    assert_metrics_equal,
    assert_nothing_left,
    cancel_jobs,
    job_ids,
    job_runs,
    launch_log,
    logged_steps,
    metrics,
    rank_pid,
    run_launch,
    slurm,
    start_launch,
    stop_launch,
    task_logs,
    wait_for_job,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TWO_NODES = ["--recipe", "demo_cpu", "--nodes", "2", "--time", "00:30:00"]
JOB_TIMEOUT_S = 900  # the machine is shared: a loaded one is slow, a hung job still ends
RESUMED = "[checkpoint] resuming from"
# tests/system/launch/slow_checkpoint.py: the first run's checkpoints take this long more, over torchrun's default 30 s grace
CHECKPOINT_DELAY_ENV = "MEGATRON_RLVR_TEST_CHECKPOINT_DELAY_S"
CHECKPOINT_DELAY_S = 35


@pytest.fixture
def home(tmp_path, slurm_cluster):
    """This test's NEMORUN_HOME; at teardown its jobs are cancelled and none of their processes may be left."""
    yield tmp_path
    cancel_jobs(tmp_path)
    assert_nothing_left(tmp_path)


def train_args(home: Path, *extra: str) -> list[str]:
    return [*TWO_NODES, *extra, *TRAIN_OVERRIDES, f"trainer.output_dir={home}/out"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_cluster):
    """The uninterrupted two-node run every resumed run is compared with: submitted when first requested (by the
    preempted job, which runs beside it) and waited for when a test reads it."""
    home = tmp_path_factory.mktemp("reference")
    launch = BackgroundLaunch("train.py", train_args(home), home)
    yield launch
    launch.stop()


SEPARATE_STEPS = 3


@pytest.fixture(scope="module")
def separate(tmp_path_factory, slurm_cluster):
    """The separate-placement run, submitted by the preempted job's fixture once that job runs: it waits in the
    queue for the reference run's slot and then runs while the preempted job sleeps in its slow checkpoint and waits
    to be requeued, when the machine would otherwise idle. Waited for by its test."""
    home = tmp_path_factory.mktemp("separate")
    args = [
        *TWO_NODES,
        "rollout.placement=separate",
        "rollout.engine_ranks=1",
        "actor.tp=1",
        "rollout.max_staleness=1",
        *TRAIN_OVERRIDES,
        f"trainer.steps={SEPARATE_STEPS}",
        f"trainer.output_dir={home}/out",
    ]
    launch = BackgroundLaunch("train.py", args, home)  # its wait counts from here: queued, it first waits for a slot
    yield launch
    launch.stop()


def _reference_metrics(reference: BackgroundLaunch) -> list[dict]:
    assert reference.wait(JOB_TIMEOUT_S) == 0, launch_log(reference.home)[-4000:]
    return metrics(reference.home / "out")


@pytest.fixture(scope="module")
def preempted(request, tmp_path_factory, slurm_cluster, reference):
    """ONE preempted job, which the two preemption tests read: submitted with `--signal USR1@600`, signalled mid-run
    as `scancel --signal=USR1 --full` does it (batch shell, torchrun and ranks), its stop's checkpoint made 35 s
    slower (tests/system/launch/slow_checkpoint.py, the first run's checkpoints only) than torchrun's default 30 s grace before
    SIGKILL, and waited for to nemo-run's verdict. Its jobs are cancelled at teardown. Once it runs, the separate-
    placement run and then the killed-rank scenario are submitted to follow the reference run into the cluster's
    second slot: they run while this job sleeps in its slow checkpoint and waits to be requeued."""
    home = tmp_path_factory.mktemp("preempted")
    slow = ["--env", f"PYTHONPATH={REPO}", "--env", f"{CALLBACKS_ENV}=tests.system.launch.slow_checkpoint"]
    slow += ["--env", f"{CHECKPOINT_DELAY_ENV}={CHECKPOINT_DELAY_S}"]
    # the lead time is torchrun's grace before SIGKILL (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): on this loaded shared machine
    # one step took over 120 s once (and the ranks were killed, as they would be on a cluster)
    launch = start_launch("train.py", train_args(home, "--signal", "USR1@600", *slow), home)
    try:  # a failure anywhere here, or after the tests, leaves neither the launcher nor the job
        job = wait_for_job(home, launch)
        request.getfixturevalue("separate")
        request.getfixturevalue("killed_rank")
        wait_until(lambda: logged_steps(home / "out") >= 1, 600, "the first logged step", launch, home)
        slurm("scancel", "--signal=USR1", "--full", str(job))
        t_signal = time.monotonic()
        launch.wait(timeout=JOB_TIMEOUT_S)
        seconds = time.monotonic() - t_signal
        yield {"home": home, "job": job, "returncode": launch.returncode, "seconds": seconds}
    finally:
        stop_launch(launch)
        cancel_jobs(home)


def _stopped_step(preempted: dict) -> int:
    first = task_logs(preempted["home"])[0]
    stopped = [line for line in first.splitlines() if "stopped after step" in line]
    assert stopped, first[-3000:]
    return int(stopped[0].split("stopped after step ")[1].split()[0])


@pytest.mark.timeout(1800)
def test_signal_checkpoint_requeue_resume(preempted, reference):
    """The signalled job stops after a step with its checkpoint, requeues itself, and its rerun resumes from that
    checkpoint to the uninterrupted run's metrics: REQUEUED, then COMPLETED."""
    home, job = preempted["home"], preempted["job"]
    assert preempted["returncode"] == 0, launch_log(home)[-4000:]
    assert job_runs(job) == [("REQUEUED", "0:0"), ("COMPLETED", "0:0")], job_runs(job)
    step = _stopped_step(preempted)
    assert step < 4
    rerun = task_logs(home)[1]
    assert f"{RESUMED} {home}/out/checkpoints/step-{step:06d}" in rerun, rerun[-3000:]  # the stop's checkpoint
    assert_metrics_equal(_reference_metrics(reference), metrics(home / "out"))
    print(f"stopped after step {step}; requeued and resumed to the end {preempted['seconds']:.0f} s after the signal")
    assert_nothing_left(home)


@pytest.mark.timeout(1800)
def test_a_checkpoint_longer_than_30_s_is_not_killed(preempted):
    """The stop's checkpoint took longer than torchrun's default grace: the ranks were given the whole lead time
    (no SIGKILL), the checkpoint was complete (the rerun resumed from it), and the job still ends COMPLETED."""
    home = preempted["home"]
    first = task_logs(home)[0]
    assert f"the checkpoint takes {CHECKPOINT_DELAY_S} s more" in first, first[-3000:]
    assert "SIGKILL" not in first, first[-3000:]
    step = _stopped_step(preempted)
    assert f"{RESUMED} {home}/out/checkpoints/step-{step:06d}" in task_logs(home)[1]
    assert preempted["returncode"] == 0 and job_runs(preempted["job"])[-1] == ("COMPLETED", "0:0")
    assert_nothing_left(home)


@pytest.mark.timeout(1200)
def test_two_node_training_succeeds(reference):
    home = reference.home
    assert reference.wait(JOB_TIMEOUT_S) == 0, launch_log(home)[-4000:]
    print(f"two-node training, 4 steps: {reference.seconds:.0f} s from launch to SUCCEEDED")
    (job,) = job_ids(home)
    assert job_runs(job) == [("COMPLETED", "0:0")]
    # the training step ran on both nodes, one torchrun each
    steps = slurm("sacct", "-n", "-P", "-o", "JobID,NodeList", "-j", str(job)).split()
    assert f"{job}.1|n[1-2]" in steps, steps
    assert [m["step"] for m in metrics(home / "out")] == [1, 2, 3, 4]
    # the logs are where nemo-run keeps the experiment: the batch script's and the srun tasks'
    assert "done: 4 steps" in task_logs(home)[0]
    assert_nothing_left(home)


def _kill_rank_twice(home: Path, launch) -> dict:
    """The killed-rank scenario's driver: kill -9 of the rank on node 2 once the step-2 checkpoint is complete (its
    pointer written, while step 3 runs), then again once the retry resumed; waits for the launcher's end."""
    latest = home / "out" / "checkpoints" / "latest"
    job = wait_for_job(home, launch)  # its wait covers the queue: the job waits for a free slot
    wait_until(
        lambda: latest.is_file() and latest.read_text().strip() == "step-000002",
        600,
        "the step-2 checkpoint",
        launch,
        home,
    )
    os.kill(rank_pid(home, "n2"), signal.SIGKILL)
    t_kill = time.monotonic()
    wait_until(lambda: RESUMED in task_logs(home).get(1, ""), 600, "the retry's resume", launch, home)
    resumed_log = task_logs(home)[1]
    os.kill(rank_pid(home, "n2"), signal.SIGKILL)  # the rerun, early in its first step
    t_kill2 = time.monotonic()
    launch.wait(timeout=JOB_TIMEOUT_S)
    return {
        "job": job,
        "resumed_log": resumed_log,
        "to_resume_s": t_kill2 - t_kill,
        "to_failed_s": time.monotonic() - t_kill2,
    }


@pytest.fixture(scope="module")
def killed_rank(tmp_path_factory, slurm_cluster):
    """The killed-rank run (8 steps, `--retries 1`), submitted by the preempted job's fixture after the separate-
    placement run, driven by `_kill_rank_twice` in a thread of its own; at teardown its jobs are cancelled and none
    of their processes may be left."""
    home = tmp_path_factory.mktemp("killed_rank")
    args = [*TWO_NODES, "--retries", "1", *TRAIN_OVERRIDES, "trainer.steps=8", f"trainer.output_dir={home}/out"]
    launch = start_launch("train.py", args, home)
    try:
        yield home, launch, InBackground(lambda: _kill_rank_twice(home, launch))
    finally:
        stop_launch(launch)  # ends the driver's waits too
        cancel_jobs(home)
        assert_nothing_left(home)


@pytest.mark.timeout(1800)
def test_a_killed_rank_fails_the_job_and_the_retry_resumes(killed_rank):
    """kill -9 of the rank on node 2 in step 3: nemo-run's retry requeues the job and the rerun resumes from the
    step-2 checkpoint; a second kill, with the retries spent, ends the job FAILED; nothing of it is left."""
    home, launch, driver = killed_rank
    seen = driver.outcome(2 * JOB_TIMEOUT_S)  # queued first, it may wait for a slot
    assert launch.returncode == 1 and "FAILED" in launch_log(home), launch_log(home)[-3000:]
    runs = job_runs(seen["job"])
    assert runs[0][0] == "REQUEUED" and runs[-1][0] == "FAILED", runs
    assert f"{RESUMED} {home}/out/checkpoints/step-000002" in seen["resumed_log"], seen["resumed_log"][-3000:]
    print(
        f"kill -9 -> requeued -> resumed at step 2 ({seen['to_resume_s']:.0f} s); second kill -> FAILED "
        f"after {seen['to_failed_s']:.0f} s"
    )
    assert_nothing_left(home)


@pytest.mark.timeout(1800)
def test_separate_placement_across_nodes(separate):
    """The actor (rank 0) on one node, the engine rank on the other, one-step-off, 3 steps."""
    home = separate.home
    assert separate.wait(2 * JOB_TIMEOUT_S) == 0, launch_log(home)[-4000:]
    (job,) = job_ids(home)
    assert job_runs(job) == [("COMPLETED", "0:0")]
    assert [m["step"] for m in metrics(home / "out")] == list(range(1, SEPARATE_STEPS + 1))
    print(f"separate placement, 3 steps one-step-off: {separate.seconds:.0f} s from submission (queued) to SUCCEEDED")
    assert_nothing_left(home)


def _eval_args(home: Path, data: Path, out: Path) -> list[str]:
    return [
        "--recipe",
        "eval_cpu",
        "--nodes",
        "2",
        "--time",
        "00:15:00",
        "eval.n_samples=256",
        "eval.chunk=64",
        f"eval.data_dir={data}",
        f"eval.output_dir={out}",
    ]


def _stored(out: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in out.glob("*/samples/shard-*.jsonl"))


@pytest.mark.timeout(1800)
def test_eval_cancelled_and_resubmitted_equals_an_uninterrupted_one(home):
    """`scancel` of a two-node eval after each rank stored its first chunk and drew its second (held there by
    tests/system/launch/stalled_eval.py, so the cancel lands mid-run on any machine), then the same command again: the table
    equals an uninterrupted run's."""
    from megatron_rlvr.tasks import countdown as task

    data = home / "data"
    data.mkdir()
    with open(data / "countdown.jsonl", "w") as f:
        for p in task.generate(0, 4, "eval"):
            f.write(json.dumps({"id": p.id, "numbers": list(p.numbers), "target": p.target}) + "\n")
    # the uninterrupted eval runs beside the one that is cancelled (the cluster runs two jobs at once)
    whole = BackgroundLaunch("eval.py", _eval_args(home, data, home / "whole"), home / "whole_home")

    try:
        cut_home = home / "cut_home"
        stall = ["--env", f"PYTHONPATH={REPO}", "--env", f"{CALLBACKS_ENV}=tests.system.launch.stalled_eval"]
        stall += ["--env", "MEGATRON_RLVR_TEST_EVAL_STALL_S=600"]
        launch = start_launch("eval.py", [*_eval_args(home, data, home / "cut"), *stall], cut_home)
        try:
            job = wait_for_job(cut_home, launch)
            wait_until(
                lambda: "before storing its second chunk" in task_logs(cut_home).get(0, ""),
                600,
                "a rank stalled after its first stored chunk",
                launch,
                cut_home,
            )
            slurm("scancel", str(job))
            launch.wait(timeout=300)
        finally:
            stop_launch(launch)
            cancel_jobs(cut_home)  # a failure before the scancel must not leave the stalled job holding the nodes
        partial = _stored(home / "cut")
        assert launch.returncode == 1 and job_runs(job)[-1][0] == "CANCELLED", job_runs(job)
        assert 64 <= partial < 4 * 256, partial
        assert_nothing_left(cut_home)
        t_again = time.monotonic()
        again = run_launch("eval.py", _eval_args(home, data, home / "cut"), home / "again_home", timeout=JOB_TIMEOUT_S)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert whole.wait(JOB_TIMEOUT_S) == 0, launch_log(whole.home)[-4000:]
        assert (home / "cut" / "table.csv").read_text() == (home / "whole" / "table.csv").read_text()
        print(
            f"eval K=256 x 4 problems on two nodes: {whole.seconds:.0f} s uninterrupted (beside the cancelled one); "
            f"cancelled after {partial} samples; resubmitted: {time.monotonic() - t_again:.0f} s"
        )
    finally:
        whole.stop()
