"""Every documented entry point turns a user error into one line on stderr and exit status 2: a misspelled key, a
layout that does not divide and a missing file, each through `megatron-rlvr train` (the documented
`--nproc-per-node` form from the recipes' headers, and one process), `megatron-rlvr demo`, `megatron-rlvr plan`,
`python launch/train.py`, `launch/eval.py`, `launch/convert.py`, `megatron-rlvr convert`, `tools/convert.py` and
`megatron-rlvr eval`. The line names the key or the file and the fix; nothing prints a traceback or torchrun's
failure report, and nothing is written. Under torchrun (through the console wrapper) a user error met by one rank,
or by every rank, is said once.

Each case is a process that stops in its checks, before any rank, engine or job starts (several seconds each: the
imports of torch and megatron-core), hence `slow`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megatron_rlvr.cli"]
GPU_RECIPE = "qwen2.5-32b_math-l3to5_casp"
# what torchrun prints when it reports a failed job itself, and what nemo-run prints for a job it started
REPORT_MARKS = ("ChildFailedError", "Root Cause", "torch.distributed.elastic", "error_file:", "[launch] task failed")

pytestmark = [pytest.mark.slow, pytest.mark.small]  # small: each case stops in its checks (tests/parallel.py)


def documented_train_command() -> list[str]:
    """The several-ranks command of configs/demo_cpu.yaml's header (the form the docs give), as argv."""
    header = (REPO / "configs" / "demo_cpu.yaml").read_text()
    match = re.search(r"^#\s+(megatron-rlvr train --nproc-per-node \d+ configs/demo_cpu\.yaml)\b", header, re.M)
    assert match, "configs/demo_cpu.yaml's header names no `megatron-rlvr train --nproc-per-node N` command"
    return CLI + shlex.split(match.group(1))[1:]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> dict[str, Path]:
    """Paths every case shares: a file and a directory that do not exist, an empty data directory, where outputs
    would go (nothing may appear there), and a nemo-run home (no job may reach it)."""
    root = tmp_path_factory.mktemp("entry_points")
    (root / "empty").mkdir()
    return {
        "missing": root / "missing" / "train.jsonl",
        "missing_dir": root / "missing" / "model",
        "empty": root / "empty",
        "out": root / "out",
        "nemorun": root / "nemorun",
    }


def cases(s: dict[str, Path]) -> dict[str, tuple[list[str], list[str]]]:
    """case -> (argv, what the one line must name: the key or file, and the fix)."""
    doc = documented_train_command()
    nproc = doc.index("--nproc-per-node") + 1
    data = [f"data.path={s['missing']}", f"data.eval_path={s['missing']}"]
    out = [f"trainer.output_dir={s['out']}"]
    launch = [sys.executable, str(REPO / "launch" / "train.py"), "--recipe", "demo_cpu"]
    launch_eval = [sys.executable, str(REPO / "launch" / "eval.py"), "--recipe", "eval_cpu"]
    hf = ["hf-to-mcore", "--hf-dir", str(s["missing_dir"]), "--out", str(s["out"] / "mcore")]
    missing_model = [f"HF config {s['missing_dir']}: not found", "megatron-rlvr convert"]
    return {
        "train --nproc-per-node: key": (
            doc + [*out, "trainer.stpes=3"],
            ["trainer.stpes", "did you mean trainer.steps"],
        ),
        "train --nproc-per-node: layout": (
            doc[:nproc] + ["3"] + doc[nproc + 1 :] + out,
            ["must divide the world size 3", "nearest layout that fits: actor.tp=1"],
        ),
        "train --nproc-per-node: data": (doc + out + data, [f"data.path: dataset file {s['missing']}", "data prepare"]),
        "train: key": (
            CLI + ["train", "configs/demo_cpu.yaml", *out, "trainer.stpes=3"],
            ["did you mean trainer.steps"],
        ),
        "train: layout": (
            CLI + ["train", "configs/demo_cpu.yaml", *out],
            ["must divide the world size 1", "or start 2 ranks: megatron-rlvr train --nproc-per-node 2"],
        ),
        "train: data": (
            CLI + ["train", "configs/demo_cpu.yaml", "actor.tp=1", *out, *data],
            [f"dataset file {s['missing']}", f"megatron-rlvr data prepare NAME ... --out {s['missing']}"],
        ),
        "demo: key": (CLI + ["demo", "--out", str(s["out"]), "trainer.stpes=3"], ["did you mean trainer.steps"]),
        "demo: layout": (
            CLI + ["demo", "--out", str(s["out"]), "--nproc", "3"],
            ["must divide the world size 3", "nearest layout that fits"],
        ),
        "demo: data": (
            CLI + ["demo", "--out", str(s["out"] / "demo"), *data],
            [f"dataset file {s['missing']}", "megatron-rlvr data prepare"],
        ),
        "plan: key": (CLI + ["plan", GPU_RECIPE, "actor.tpp=2"], ["actor.tpp", "did you mean actor.tp?"]),
        "plan: layout": (CLI + ["plan", GPU_RECIPE, "actor.tp=3"], ["actor.tp=3 must divide", "TPs that would"]),
        "plan: recipe": (
            CLI + ["plan", "qwen2.5-32b_math-l3to5_caps"],
            ["recipe 'qwen2.5-32b_math-l3to5_caps'", "known"],
        ),
        "launch/train.py: key": (launch + ["trainer.stpes=3"], ["did you mean trainer.steps"]),
        "launch/train.py: layout": (launch + ["--nproc-per-node", "3"], ["world size 3", "nearest layout that fits"]),
        "launch/train.py: data": (launch + data, [f"dataset file {s['missing']}", "megatron-rlvr data prepare"]),
        "launch/eval.py: key": (launch_eval + ["eval.n_sample=4"], ["did you mean eval.n_samples"]),
        "launch/eval.py: layout": (
            launch_eval + ["rollout.tp=3"],
            ["rollout.tp=3 must divide", "TPs that would: 1, 2"],
        ),
        "launch/eval.py: data": (
            launch_eval + [f"eval.data_dir={s['empty']}"],
            ["benchmark 'countdown': no data file", "megatron-rlvr data prepare countdown"],
        ),
        "launch/convert.py: model": ([sys.executable, str(REPO / "launch" / "convert.py"), "--", *hf], missing_model),
        "convert: model": (CLI + ["convert", *hf], missing_model),
        "tools/convert.py: model": ([sys.executable, str(REPO / "tools" / "convert.py"), *hf], missing_model),
        "eval: data": (
            CLI
            + [
                "eval",
                "--model",
                "megatron_rlvr/demo/model",
                "--benchmarks",
                "countdown",
                "--data-dir",
                str(s["empty"]),
            ]
            + ["--out", str(s["out"] / "eval")],
            ["benchmark 'countdown': no data file", "megatron-rlvr data prepare countdown"],
        ),
    }


def run(argv: list[str], nemorun_home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_RLVR_", "SBATCH_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NEMORUN_HOME=str(nemorun_home))
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def assert_one_line(result: subprocess.CompletedProcess, names: list[str]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, (result.returncode, output[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(("error: ", "convert: error: ")), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert "Traceback" not in output and not [m for m in REPORT_MARKS if m in output], output[-3000:]


@pytest.mark.parametrize("case", list(cases({k: Path(k) for k in ("missing", "missing_dir", "empty", "out")})))
def test_a_user_error_is_one_line_and_exit_2(scratch, case):
    argv, names = cases(scratch)[case]
    assert_one_line(run(argv, scratch["nemorun"]), names)
    assert not scratch["out"].exists(), "a user error writes nothing"
    assert not scratch["nemorun"].exists(), "a user error reaches no nemo-run job"


def test_the_documented_commands_are_the_clean_forms():
    """No recipe header or runnable doc block starts training with plain torchrun (its report wraps every user
    error); they use `megatron-rlvr train --nproc-per-node N`, the command the cases above run."""
    plain = re.compile(r"^\s*(#\s+)?(\S*/)?torchrun\s.*-m megatron_rlvr\.cli train\b")
    texts = {p: p.read_text() for p in [*(REPO / "configs").glob("*.yaml"), REPO / "README.md"]}
    texts.update({p: p.read_text() for p in (REPO / "docs").glob("*.md")})
    found = [
        f"{p.name}: {line.strip()}" for p, text in texts.items() for line in text.splitlines() if plain.match(line)
    ]
    assert not found, found
    assert documented_train_command()[len(CLI) :][:3] == ["train", "--nproc-per-node", "2"]


@pytest.mark.parametrize("who", ["one", "every"])
def test_under_torchrun_the_first_rank_to_meet_a_user_error_says_it_once(tmp_path, who):
    argv = [sys.executable, "-m", "megatron_rlvr.runtime.console", "--standalone", "--nproc-per-node", "2"]
    result = run([*argv, "-m", "tests.integration.user_error_rank", who], tmp_path / "nemorun")
    assert_one_line(result, ["data.path: dataset file x.jsonl: not found (met on rank"])


LOCAL_LAUNCH = """
import sys
sys.path.insert(0, sys.argv[1])
from launch.executors import run_task
from launch.options import LaunchOptions
sys.exit(run_task("user_error", ["one"], LaunchOptions(executor="local", nproc_per_node=2), module="tests.integration.user_error_rank"))
"""


def test_a_local_launch_whose_rank_meets_a_user_error_ends_with_that_line(tmp_path):
    """What `python launch/train.py --recipe demo_cpu` runs, with a task whose rank 1 meets a user error once
    started (nemo-run streams the job's own output on stdout)."""
    result = run([sys.executable, "-c", LOCAL_LAUNCH, str(REPO)], tmp_path / "nemorun")
    assert_one_line(result, ["data.path: dataset file x.jsonl: not found (met on rank 1)"])
