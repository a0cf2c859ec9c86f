"""The nemo-run launchers: Slurm dry runs write the sbatch script we expect, bad input never reaches a cluster, and
the local executor runs real torchrun tasks to completion and reports a failing one with a non-zero exit.

Each launch runs in a subprocess with its own NEMORUN_HOME, as a user would run it (nemo-run fixes its home at
import time, so one process cannot host launches into different homes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.recipes import REPO_ROOT, recipe_job_main

PY = sys.executable
IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
SLURM = [
    "--executor",
    "slurm_h200",
    "--account",
    "rl_acct",
    "--partition",
    "batch",
    "--container-image",
    IMAGE,
    "--mount",
    "/lustre/models:/models",
    "--mount",
    "/lustre/results:/results",
    "--time",
    "02:00:00",
]


def launch(script: str, args: list[str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "MEGATRON_RLVR_"))}
    env["NEMORUN_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [PY, str(REPO_ROOT / "launch" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=home,
    )  # not the repo: the launcher must find it itself


def sbatch_file(stdout: str) -> Path:
    match = re.search(r"^# sbatch script: (\S+)$", stdout, re.MULTILINE)
    assert match, stdout
    return Path(match.group(1))


def test_slurm_dryrun_writes_the_sbatch_script(tmp_path):
    out = launch(
        "train.py",
        [
            "--recipe",
            "qwen2.5-32b_math-l3to5_casp",
            *SLURM,
            "--nodes",
            "4",
            "--dryrun",
            "algo.loss.alpha=0.01",
            "trainer.steps=7",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: model.hf_dir" not in out.stderr and "warning: data.path=/data/" in out.stderr
    assert re.search(r"\[plan\] peak [\d.]+ GB per GPU \(actor, rollout\) of 141 GB: fits", out.stderr), out.stderr
    path = sbatch_file(out.stdout)
    script = path.read_text()
    assert script in out.stdout, "the dry run prints the script it wrote"
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --account=rl_acct",
        "#SBATCH --partition=batch",
        "#SBATCH --time=02:00:00",
        "#SBATCH --exclusive",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export NCCL_NVLS_ENABLE=0",
    ):
        assert line in script.splitlines(), line
    srun = next(line for line in script.splitlines() if line.startswith("srun ") and "torchrun" in line)
    assert f"--container-image {IMAGE}" in srun
    assert re.search(r"--container-mounts /lustre/models:/models,/lustre/results:/results,\S+:/nemo_run", srun)
    assert "torchrun" in srun and "--nnodes 4 --nproc-per-node 8" in srun
    assert srun.endswith("-m megatron_rlvr.cli train /nemo_run/configs/run_config.yaml")
    # the resolved config travels in the job directory (mounted at /nemo_run), overrides applied
    shipped = path.parent / "train_qwen2_5-32b_math-l3to5_casp" / "configs" / "run_config.yaml"
    cfg = yaml.safe_load(shipped.read_text())
    assert cfg["algo"]["loss"]["alpha"] == 0.01 and cfg["trainer"]["steps"] == 7 and cfg["actor"]["tp"] == 8
    assert (shipped.parent.parent / "code" / "launch" / "executors.py").is_file(), "the committed repo is shipped"


def test_slurm_options_come_from_the_environment_too(tmp_path):
    env_args = ["--recipe", "qwen2.5-math-7b_math-l3to5_casp", "--executor", "slurm_h200", "--dryrun"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "MEGATRON_RLVR_"))}
    env.update(
        NEMORUN_HOME=str(tmp_path),
        SBATCH_ACCOUNT="env_acct",
        SBATCH_PARTITION="h200",
        MEGATRON_RLVR_CONTAINER="registry/rlvr:1",
        MEGATRON_RLVR_MOUNTS="/fs/models:/models",
    )
    out = subprocess.run(
        [PY, str(REPO_ROOT / "launch" / "train.py"), *env_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "#SBATCH --account=env_acct" in script and "#SBATCH --partition=h200" in script
    assert "--container-image registry/rlvr:1" in script and "/fs/models:/models" in script
    assert "--nnodes 1 --nproc-per-node 8" in script


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--recipe", "qwen2.5-32b_math-l3to5_casp", *SLURM, "--nodes", "4", "algo.loss.alpha=lots"],
            "algo.loss.alpha",
        ),
        (["--recipe", "qwen2.5-32b_math-l3to5_casp", *SLURM, "--nodes", "4", "algo.no_such_knob=1"], "no_such_knob"),
        (
            [
                "--recipe",
                "qwen2.5-math-7b_math-l3to5_casp",
                *SLURM,
                "--nodes",
                "1",
                "--nproc-per-node",
                "6",
                "actor.tp=4",
            ],
            "world size 6",
        ),
        (
            [
                "--recipe",
                "qwen2.5-32b_math-l3to5_casp",
                "--executor",
                "slurm_h200",
                "--container-image",
                IMAGE,
                "--nodes",
                "4",
            ],
            "--account",
        ),
        (
            ["--recipe", "qwen2.5-32b_math-l3to5_casp", "--executor", "slurm_h200", "--account", "a", "--nodes", "4"],
            "--container-image",
        ),
        (["--recipe", "qwen2.5-32b_math-l3to5_casp", *SLURM, "--nodes", "4", "rollout.top_p=2"], "rollout.top_p"),
        (["--recipe", "nope"], "known recipes"),
    ],
)
def test_bad_input_exits_nonzero_before_anything_is_submitted(tmp_path, monkeypatch, capsys, args, message):
    for key in [k for k in os.environ if k.startswith(("SBATCH_", "MEGATRON_RLVR_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path))
    dryrun = [] if message.startswith("--") else ["--dryrun"]  # a dry run shows placeholders for site settings
    rc = recipe_job_main("train", [*args, *dryrun], "")  # in-process: it must fail before nemo-run is imported
    err = capsys.readouterr().err
    assert rc == 2 and message in err, (rc, err[-2000:])
    assert not (tmp_path / "experiments").exists(), "nothing may reach nemo-run"


def test_a_layout_the_plan_says_cannot_fit_is_refused_before_anything_is_submitted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path))
    args = [
        "--recipe",
        "qwen2.5-32b_math-l3to5_casp",
        *SLURM,
        "--nodes",
        "4",
        "actor.tp=1",
        "actor.sequence_parallel=false",
    ]
    assert recipe_job_main("train", args, "") == 3
    err = capsys.readouterr().err
    assert "error: the memory plan does not fit" in err and "actor_grads" in err and "--force" in err
    assert not (tmp_path / "experiments").exists(), "nothing may reach nemo-run"


def test_force_queues_a_layout_that_does_not_fit(tmp_path):
    out = launch(
        "train.py",
        [
            "--recipe",
            "qwen2.5-32b_math-l3to5_casp",
            *SLURM,
            "--nodes",
            "4",
            "--dryrun",
            "--force",
            "actor.tp=1",
            "actor.sequence_parallel=false",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "does not fit" in out.stderr and "queued anyway (--force)" in out.stderr
    assert "#SBATCH --nodes=4" in sbatch_file(out.stdout).read_text()


def test_convert_dryrun_starts_the_convert_subcommand(tmp_path):
    out = launch(
        "convert.py",
        [
            *SLURM,
            "--dryrun",
            "--",
            "hf-to-mcore",
            "--hf-dir",
            "/models/Qwen2.5-32B",
            "--out",
            "/models/Qwen2.5-32B-mcore",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=1" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun ") and "megatron_rlvr.cli" in line)
    assert "torchrun" not in srun, "the converter is one plain process"
    expected = (
        "python -m megatron_rlvr.cli convert hf-to-mcore --hf-dir /models/Qwen2.5-32B --out /models/Qwen2.5-32B-mcore"
    )
    assert srun.endswith(expected), srun


def test_k1024_eval_dryrun_runs_one_engine_with_the_recipes_flags(tmp_path):
    out = launch(
        "eval.py",
        ["--recipe", "eval_k1024_qwen2.5-math-7b", *SLURM, "--dryrun", "model.hf_dir=/results/casp_hf"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "#SBATCH --nodes=1" in script and "--nnodes 1 --nproc-per-node 4" in script  # the engine's TP=4 ranks
    srun = next(line for line in script.splitlines() if line.startswith("srun ") and "torchrun" in line)
    # `--`: torchrun's own parser would refuse eval's `--n` as an ambiguous abbreviation of its options
    command = srun[srun.index("-m megatron_rlvr.cli -- eval ") :]
    for flags in (
        "--model /results/casp_hf",
        "--benchmarks aime24 aime25 amc23",
        "--n 1024",
        "--out /results/eval/eval_k1024_qwen2.5-math-7b",
        "--temperature 0.6",
        "--top-p 0.95",
        "--max-new-tokens 3072",
        "--max-model-len 4096",
        "--tp 4",
    ):
        assert f" {flags} " in f"{command} ", flags


def test_local_one_process_eval_dryrun_runs_without_torchrun(tmp_path):
    out = launch("eval.py", ["--recipe", "eval_cpu", "--dryrun", "eval.n_samples=32"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.split("# local executor: one process\n", 1)[1].strip()  # one shell command (stop: a newline)
    assert line.startswith("python -m megatron_rlvr.cli eval --model megatron_rlvr/demo/model --benchmarks countdown ")
    assert " --n 32 " in line and line.endswith(" --stop '\n'")


def test_eval_refuses_more_than_one_node(capsys):
    assert recipe_job_main("eval", ["--recipe", "eval_k1024_qwen2.5-math-7b", *SLURM, "--nodes", "2"], "") == 2
    assert "megatron-rlvr eval runs one vLLM engine; use --nodes 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Real local runs through nemo-run (torchrun, 2 gloo processes)

_RUN_RANK_TASK = """
import sys
sys.path.insert(0, sys.argv[1])
from launch.executors import run_task
from launch.options import LaunchOptions
sys.exit(run_task("rank_task", [sys.argv[2], sys.argv[3]], LaunchOptions(executor="local", nproc_per_node=2),
                  module="tests.integration.launch.rank_task"))
"""


def run_rank_task(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    result = tmp_path / f"result_{mode}.txt"
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemorun"), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [PY, "-c", _RUN_RANK_TASK, str(REPO_ROOT), str(result), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    return out, result


@pytest.mark.slow
@pytest.mark.dist
def test_local_executor_runs_a_torchrun_task_to_completion(tmp_path):
    out, result = run_rank_task(tmp_path, "ok")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert result.read_text() == "world=2 sum=3\n"  # ranks 0 and 1 all-reduced 1 + 2


@pytest.mark.slow
@pytest.mark.dist
def test_a_failing_task_makes_the_launcher_exit_nonzero(tmp_path):
    out, result = run_rank_task(tmp_path, "fail")
    assert out.returncode == 1, (out.stdout + out.stderr)[-3000:]
    assert "[launch] task failed: rank_task: FAILED" in out.stderr
    assert result.read_text() == "world=2 sum=3\n", "the job ran; only the last rank's exit status 3 failed it"


@pytest.mark.slow
def test_local_executor_converts_a_tiny_checkpoint_through_the_real_cli(tmp_path):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    hf_dir = make_tiny_hf_model("qwen2", tmp_path / "tiny_hf")
    out = launch(
        "convert.py",
        ["--", "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "mcore")],
        tmp_path / "home",
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert f"convert: wrote {tmp_path / 'mcore'}" in out.stdout
    assert (tmp_path / "mcore" / "metadata.json").is_file()


# The demo recipe through the local executor (launch/train.py -> nemo-run -> torchrun -> the trainer) is
# docs/cluster.md's first local command, which tests/system/docs/test_doc_commands.py runs with the eval and convert
# launchers after it.


def test_the_bare_readme_dryrun_prints_an_sbatch_script_with_placeholders(tmp_path):
    out = launch(
        "train.py",
        ["--recipe", "qwen2.5-32b_math-l3to5_casp", "--executor", "slurm_h200", "--nodes", "4", "--dryrun"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "#SBATCH --account=YOUR_ACCOUNT" in out.stdout and "--container-image YOUR_CONTAINER_IMAGE" in out.stdout
    assert "--nnodes 4 --nproc-per-node 8" in out.stdout
    assert "--account not given, shown as YOUR_ACCOUNT" in out.stderr
    assert "warning: model.hf_dir=/models/Qwen2.5-32B is under no --mount" in out.stderr


_RUN_STOPPING_RANKS = """
import sys
sys.path.insert(0, sys.argv[1])
from launch.executors import run_task
from launch.options import LaunchOptions
sys.exit(run_task("stopping", [sys.argv[2], "finish", "4"], LaunchOptions(executor="local", nproc_per_node=2),
                  module="tests.support.runtime.stopping_rank"))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_ctrl_c_to_a_local_launch_lets_the_ranks_finish_their_step_and_exits_0(tmp_path):
    """The local executor's task is the console's torchrun, in a session of its own: Ctrl-C (SIGINT) to the launch
    process goes on to it and from there to the ranks as their stop request, and nemo-run waits for them."""
    import signal
    import time

    import psutil

    env = dict(
        os.environ, NEMORUN_HOME=str(tmp_path / "nemorun"), OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1"
    )
    proc = subprocess.Popen(
        [PY, "-c", _RUN_STOPPING_RANKS, str(REPO_ROOT), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:  # on a failure: the task and its ranks run in sessions of their own, so each goes by its pid
        for leftover in [*psutil.Process(proc.pid).children(recursive=True), proc] if proc.poll() is None else []:
            leftover.kill()
        proc.wait()
    assert proc.returncode == 0, output[-3000:]
    for rank in (0, 1):  # one SIGTERM each, the step finished after it (> torchrun's 1 s of grace)
        assert (tmp_path / f"rank{rank}").read_text().split()[0] == "SIGTERM", output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
