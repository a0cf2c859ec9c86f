"""The `slurm_local` executor without a cluster (fast): what its job script asks for, that torchrun's own parser
accepts the task line it writes, and that the batch-shell lines which requeue a stopped run do what they say, run by
bash with a recording `scontrol`. The real cluster runs them in test_slurm_local.py."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess

import pytest

from launch.slurm_local import STOP_MARKER_ENV, stop_requeue_lines
from megatron_rlvr.runtime import preemption
from tests.integration.launch.test_launch import launch, sbatch_file


def test_two_node_training_script(tmp_path):
    out = launch(
        "train.py",
        [
            "--recipe",
            "demo_cpu",
            "--executor",
            "slurm_local",
            "--nodes",
            "2",
            "--dryrun",
            "--signal",
            "USR1@120",
            "--time",
            "00:30:00",
            "--retries",
            "2",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sbatch_file(out.stdout).read_text().splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --signal=USR1@120",
        "export TORCHX_MAX_RETRIES=2",
        "export OMP_NUM_THREADS=1",
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120",
        "trap megatron_rlvr_requeue_on_stop EXIT",
    ):
        assert line in lines, line
    assert not any(line.startswith("#SBATCH --account") and line != "#SBATCH --account=''" for line in lines)
    srun = next(line for line in lines if line.startswith("srun ") and "torchrun" in line)
    assert "--nnodes 2 --nproc-per-node 1" in srun and ":29500 " not in srun  # a free port, not nemo-run's fixed one
    assert srun.endswith(f"-m megatron_rlvr.cli train {tmp_path}/shipped/" + srun.split("/shipped/")[1])


def test_h200_training_ranks_write_the_marker_into_the_mounted_job_dir(tmp_path):
    from tests.integration.launch.test_launch import SLURM

    out = launch("train.py", ["--recipe", "qwen2.5-math-7b_math-l3to5_casp", *SLURM, "--dryrun"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sbatch_file(out.stdout).read_text().splitlines()
    assert f'export {STOP_MARKER_ENV}="/nemo_run/stop_${{SLURM_JOB_ID}}_${{SLURM_RESTART_COUNT:-0}}"' in lines
    assert "trap megatron_rlvr_requeue_on_stop EXIT" in lines


def test_eval_task_line_passes_torchruns_parser(tmp_path):
    """torchrun parses the task's options too: eval's `--n` was refused as an abbreviation of its own options."""
    from torch.distributed.run import get_args_parser

    out = launch(
        "eval.py",
        ["--recipe", "eval_cpu", "--executor", "slurm_local", "--nodes", "2", "--dryrun", "eval.n_samples=256"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "--signal" not in script and STOP_MARKER_ENV not in script  # eval stops on no warning
    srun = next(line for line in script.split("\nsrun ")[1:] if "torchrun" in line)
    words = shlex.split(srun.replace("$head_node_ip", "127.0.0.1").replace("$SLURM_NODEID", "0"))
    args = get_args_parser().parse_args(words[words.index("torchrun") + 1 :])
    assert args.training_script == "megatron_rlvr.cli" and args.training_script_args[:1] == ["eval"]
    assert args.training_script_args[args.training_script_args.index("--n") + 1] == "256"


def _batch_shell(tmp_path, marker: bool, status: int, retries: int, restart: int) -> tuple[int, str]:
    """Run the requeue lines as the batch script does (then exit `status`), with a `scontrol` that records."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    job_dir = tmp_path / "job"
    job_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(  # `show job -o`: one line of Key=Value; `requeue`: recorded
        f'#!/bin/sh\nif [ "$1" = show ]; then echo "JobId=$3 JobName=x StdOut={job_dir}/sbatch_x_$3.out Partition=local"\n'
        f'else echo "$@" >> {tmp_path}/scontrol.calls; fi\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    script = "\n".join(
        [
            stop_requeue_lines(),
            f'[ {int(marker)} -eq 1 ] && echo SIGUSR1 > "${STOP_MARKER_ENV}"',
            # nemo-run's own retry, as its template has it
            f'if [ {status} -ne 0 ] && [ "$TORCHX_MAX_RETRIES" -gt "${{SLURM_RESTART_COUNT:-0}}" ]; '
            'then scontrol requeue "$SLURM_JOB_ID"; fi',
            f"exit {status}",
        ]
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_RESTART_COUNT": str(restart),
        "TORCHX_MAX_RETRIES": str(retries),
    }
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    calls = tmp_path / "scontrol.calls"
    assert not marker or (job_dir / f"stop_42_{restart}").read_text() == "SIGUSR1\n"  # where the shell looked
    return done.returncode, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize(
    "marker, status, retries, restart, exit_status, requeues",
    [
        (True, 1, 0, 0, 0, 1),  # stopped on the signal, torchrun exited 1, no retries: requeued by us, exit 0
        (True, 1, 3, 5, 0, 1),  # the same with the retries spent by earlier stops: still requeued
        (True, 1, 2, 0, 0, 1),  # nemo-run's retry requeued it already: not twice
        (True, 0, 0, 0, 0, 1),  # the ranks and torchrun exited 0 after the stop
        (False, 1, 0, 0, 1, 0),  # a failure without retries: FAILED, no requeue
        (False, 1, 1, 0, 1, 1),  # a failure with a retry left: nemo-run's requeue only
        (False, 0, 0, 0, 0, 0),  # done
    ],
)
def test_a_stopped_run_requeues_its_job_once(tmp_path, marker, status, retries, restart, exit_status, requeues):
    code, calls = _batch_shell(tmp_path, marker, status, retries, restart)
    assert code == exit_status
    assert calls.splitlines() == ["requeue 42"] * requeues


def test_the_batch_shell_survives_usr1(tmp_path):
    """`scancel --signal=USR1 --full` signals the batch shell too: it must live on to requeue the job."""
    script = stop_requeue_lines() + "\nkill -USR1 $$\nsleep 0.2\necho alive\n"
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=30, env={**os.environ, "SLURM_JOB_ID": "7"}
    )
    assert done.returncode == 0 and "alive" in done.stdout and "got SIGUSR1" in done.stdout


def test_the_agreed_stop_leaves_the_marker(tmp_path, monkeypatch):
    marker = tmp_path / "stop_7_0"
    monkeypatch.setenv(preemption.STOP_MARKER_ENV, str(marker))
    handler = preemption.Preemption()
    assert not handler.requested() and not marker.exists()
    handler.signum = signal.SIGUSR1
    assert handler.requested()
    assert marker.read_text() == "SIGUSR1\n"
    assert STOP_MARKER_ENV == preemption.STOP_MARKER_ENV
