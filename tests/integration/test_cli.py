"""The command line's user errors: one line ``error: ...`` on stderr, exit status 2, no traceback (one test per error
class: config, data, checkpoint, model, launch; and inside `train` under torchrun); --debug shows the traceback;
third-party log lines stay off the console (in the log file) unless --verbose."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megatron_rlvr.cli"]

pytestmark = pytest.mark.small  # one process at a time, or two ranks of the demo's tiny model (tests/parallel.py)


def run(cmd, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("MEGATRON_RLVR_DEBUG", None)
    env.pop("MEGATRON_RLVR_VERBOSE", None)
    env.pop("MEGATRON_RLVR_LOG_DIR", None)
    return subprocess.run(
        cmd, cwd=REPO, env={**env, **(env_extra or {})}, capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_error(result, expected_start: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(expected_start), result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout


def test_config_error_in_train(tmp_path):
    result = run(CLI + ["train", "configs/demo_cpu.yaml", "actor.nope=1", f"trainer.output_dir={tmp_path}"])
    assert_one_line_error(result, "error: actor.nope: unknown key; allowed keys: ")


def test_data_error(tmp_path):
    result = run(CLI + ["data", "prepare", "math", "--src", str(tmp_path / "MATH"), "--out", str(tmp_path / "o.jsonl")])
    assert_one_line_error(result, f"error: --src {tmp_path / 'MATH'}: not found; give the release's directory")


def test_data_row_error_names_the_row(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    result = run(
        CLI
        + [
            "data",
            "prepare",
            "gsm8k",
            "--src",
            str(tmp_path / "train.jsonl"),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--strict",
        ]
    )
    assert_one_line_error(result, f"error: {tmp_path / 'train.jsonl'}:1: gsm8k row skipped: no '#### <answer>'")


def test_checkpoint_error(tmp_path):
    result = run(CLI + ["ckpt", "verify", str(tmp_path / "missing")])
    assert_one_line_error(result, f"error: {tmp_path / 'missing'}: neither a checkpoint")


@pytest.mark.slow
def test_checkpoint_error_inside_train(tmp_path):
    result = run(
        CLI
        + [
            "train",
            "configs/demo_cpu.yaml",
            "actor.tp=1",
            f"checkpoint.resume={tmp_path / 'missing'}",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: checkpoint.resume={tmp_path / 'missing'}: DAMAGED {tmp_path / 'missing'}: .: the checkpoint directory is missing"
    ]


def test_model_error(tmp_path):
    (tmp_path / "model").mkdir()
    result = run(
        CLI + ["eval", "--model", str(tmp_path / "model"), "--benchmarks", "countdown", "--out", str(tmp_path / "o")]
    )
    assert_one_line_error(result, f"error: --model {tmp_path / 'model'}: not an HF model directory (no config.json)")


def test_benchmark_file_error(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = run(
        CLI
        + [
            "eval",
            "--model",
            str(model),
            "--benchmarks",
            "math500",
            "--data-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert_one_line_error(result, "error: benchmark 'math500': no data file; tried ")


def test_candidates_model_error(tmp_path):
    result = run(
        CLI + ["candidates", "--model", "megatron_rlvr/demo/model", str(tmp_path / "nope"), "--prompt", "1 2 -> 3:"]
    )
    assert_one_line_error(result, f"error: --model {tmp_path / 'nope'}: not an HF model directory (no config.json)")


def test_demo_report_runs_error(tmp_path):
    result = run(CLI + ["demo", "report", "--runs", str(tmp_path / "nope")])
    assert_one_line_error(result, f"error: --runs {tmp_path / 'nope'}: no finished demo run (")


def test_launch_error():
    result = run([sys.executable, "launch/train.py", "--recipe", "demo_cpu", "--executor", "local", "--nodes", "2"])
    assert_one_line_error(result, "error: --nodes 2: the local executor runs on this machine only; use 1")


def test_debug_flag_and_variable_show_the_traceback(tmp_path):
    args = ["data", "prepare", "math", "--src", str(tmp_path / "MATH"), "--out", str(tmp_path / "o.jsonl")]
    for result in (run(CLI + ["--debug"] + args), run(CLI + args, {"MEGATRON_RLVR_DEBUG": "1"})):
        assert result.returncode == 2
        assert "Traceback (most recent call last)" in result.stderr and "DataError" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("error: --src ")


def test_a_bug_keeps_its_traceback():
    from megatron_rlvr import cli

    def broken(argv):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        cli.main(["data", "prepare"], resolve=lambda name: broken)


@pytest.mark.slow
def test_user_error_in_train_under_torchrun_is_one_line_from_rank_0():
    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.runtime.console",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "megatron_rlvr.cli",
        "train",
        "configs/demo_cpu.yaml",
        "actor.nope=1",
    ]
    result = run(cmd)
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "actor.nope" in line] == [
        line for line in output.splitlines() if line.startswith("error: actor.nope: unknown key")
    ]
    assert len([line for line in output.splitlines() if "actor.nope" in line]) == 1  # rank 0 only
    assert "Traceback" not in output


CHATTER = """
import logging, warnings
from megatron_rlvr.runtime.console import setup_console
setup_console(log_dir={log_dir!r}, name="probe")
logging.getLogger("vllm.v1.engine").info("Successfully reset prefix cache")
logging.getLogger("megatron.core.utils").warning("a megatron-core warning")
warnings.warn("a python warning from a library")
logging.getLogger("megatron_rlvr.eval.runner").info("our own progress")
logging.getLogger("vllm.v1.engine").error("a vLLM error")
import os; print(os.environ["VLLM_CONFIGURE_LOGGING"])
"""


def test_third_party_lines_go_to_the_log_file_not_the_console(tmp_path):
    quiet = run([sys.executable, "-c", CHATTER.format(log_dir=str(tmp_path))])
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "0"  # vLLM installs no console handler of its own
    shown = quiet.stderr
    assert "our own progress" in shown and "a vLLM error" in shown
    for line in ("Successfully reset prefix cache", "a megatron-core warning", "a python warning"):
        assert line not in shown
    logged = (tmp_path / "logs" / "probe.log").read_text()
    for line in ("Successfully reset prefix cache", "a megatron-core warning", "a python warning", "our own progress"):
        assert line in logged
    verbose = run([sys.executable, "-c", CHATTER.format(log_dir=str(tmp_path))], {"MEGATRON_RLVR_VERBOSE": "1"})
    assert "Successfully reset prefix cache" in verbose.stderr and "a megatron-core warning" in verbose.stderr
