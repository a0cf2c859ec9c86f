"""`--dryrun` without a nemo-run home (no --nemorun-home, no $NEMORUN_HOME) prints the job and writes nothing: not
under HOME (nemo-run's default home, ~/.nemo_run), not in the working directory, and no temporary directory is left
behind. docs/cluster.md says what a dry run writes when a home is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.small  # one launcher process at a time, stopping at its dry run (tests/parallel.py)


@pytest.mark.parametrize(
    "args, shown",
    [
        (["--recipe", "qwen2.5-32b_math-l3to5_casp", "--executor", "slurm_h200", "--nodes", "4"], "#SBATCH --nodes=4"),
        (
            ["--recipe", "demo_cpu", "trainer.steps=3"],
            "python -m megatron_rlvr.runtime.console --standalone --nproc-per-node=2 -m megatron_rlvr.cli train",
        ),
    ],
    ids=["slurm_h200", "local"],
)
def test_a_dry_run_in_a_scratch_home_writes_nothing(tmp_path, args, shown):
    home, cwd, tmp = tmp_path / "home", tmp_path / "cwd", tmp_path / "tmp"
    for folder in (home, cwd, tmp):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "MEGATRON_RLVR_", "NEMORUN_"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), *args, "--dryrun"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for folder in (home, cwd, tmp):
        assert not list(folder.rglob("*")), f"the dry run wrote {sorted(folder.rglob('*'))[:5]}"
    assert shown in result.stdout and "keeps no files" in result.stdout, result.stdout[-3000:]
