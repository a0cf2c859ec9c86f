"""A Slurm training job asks for the warning signal before its time limit (`#SBATCH --signal=USR1@300` by default)
and tells torchrun to forward it to the ranks and to wait the whole lead time for their checkpoint; jobs that do
not stop cleanly on it (convert, eval) ask for none; a value that could not work is refused before submission."""

from __future__ import annotations

import os

import pytest

from launch.options import LaunchError, check_signal, signal_env, time_limit_seconds
from launch.recipes import recipe_job_main
from tests.integration.launch.test_launch import SLURM, launch, sbatch_file

TRAIN = ["--recipe", "qwen2.5-math-7b_math-l3to5_casp", *SLURM, "--dryrun"]


def _lines(script: str) -> list[str]:
    return script.splitlines()


def test_training_asks_for_the_warning_and_torchrun_forwards_it(tmp_path):
    out = launch("train.py", TRAIN, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(sbatch_file(out.stdout).read_text())
    assert "#SBATCH --signal=USR1@300" in lines  # no "B:": every process of the step, torchrun and ranks
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in lines
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300" in lines


def test_the_signal_is_an_option_and_none_turns_it_off(tmp_path):
    out = launch("train.py", [*TRAIN, "--signal", "SIGTERM@900"], tmp_path / "term")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(sbatch_file(out.stdout).read_text())
    assert "#SBATCH --signal=TERM@900" in lines and "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=900" in lines
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT" in lines  # TERM is in torchrun's own list
    out = launch("train.py", [*TRAIN, "--signal", "none"], tmp_path / "none")
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "--signal" not in script and "PET_SIGNALS_TO_HANDLE" not in script


def test_convert_jobs_ask_for_no_signal(tmp_path):
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
            "/results/q32_tp8",
            "--tp",
            "8",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    script = sbatch_file(out.stdout).read_text()
    assert "--signal" not in script and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in script


@pytest.mark.parametrize(
    "value, message",
    [
        ("B:USR1@300", "without 'B:'"),
        ("KILL@300", "USR1, TERM"),
        ("USR1", "expected SIG@SECONDS"),
        ("USR1@7200", "at or before its start"),  # the job has --time 02:00:00
    ],
)
def test_a_signal_that_cannot_work_is_refused_before_submission(tmp_path, monkeypatch, capsys, value, message):
    for key in [k for k in os.environ if k.startswith(("SBATCH_", "MEGATRON_RLVR_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path))
    assert recipe_job_main("train", [*TRAIN, "--signal", value], "") == 2
    err = capsys.readouterr().err
    assert f"--signal {value!r}" in err and message in err


def test_time_limits_and_signal_values():
    assert [time_limit_seconds(t) for t in ("30", "30:15", "04:00:00", "1-12", "1-12:30", "2-00:00:05")] == [
        1800,
        1815,
        14400,
        129600,
        131400,
        172805,
    ]
    assert time_limit_seconds("UNLIMITED") is None
    with pytest.raises(LaunchError, match="--time '4h'"):
        time_limit_seconds("4h")
    assert check_signal("sigusr1@120", "01:00:00") == "USR1@120"
    assert signal_env("USR1@120") == {
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120",
    }
