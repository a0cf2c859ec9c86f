"""The suite's tiers (tests/tiers.py): which commands count as the project's processes, and that a unit test starting
one, or a worker group, fails before anything starts, naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rlvr.testing.workers import WorkerGroup
from tests.tiers import REPO, project_command


@pytest.mark.parametrize(
    "argv,project",
    [
        ([sys.executable, "-m", "megatron_rlvr.cli", "train"], True),
        ([".venv/bin/megatron-rlvr", "plan", "demo_cpu"], True),
        ("torchrun --standalone --nproc-per-node 2 -m megatron_rlvr.cli train", True),
        ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"], True),
        ([sys.executable, str(REPO / "launch" / "train.py"), "--dryrun"], True),
        ([sys.executable, str(REPO / "tools" / "convert.py"), "gguf-to-hf"], True),
        ([sys.executable, "-c", "import json, torch\nprint(torch.__version__)"], True),
        ([sys.executable, str(REPO / "tools" / "checks" / "check_imports.py")], False),  # the standard library only
        ([sys.executable, "-I", "-S", str(REPO / "megatron_rlvr" / "rewards" / "sandbox_launcher.py")], False),
        ([sys.executable, "-c", "print('import torch')"], False),
        (["bash", "-c", "# megatron-rlvr: a comment"], False),
        (["git", "ls-files"], False),
    ],
)
def test_the_projects_processes_are_told_from_helpers(argv, project):
    assert bool(project_command(argv)) == project


def test_a_unit_test_that_starts_a_project_process_or_a_worker_group_fails_naming_it():
    with pytest.raises(RuntimeError, match=r"test_tiers\.py::.* is in the unit tier but started the process `.*-m "):
        subprocess.Popen([sys.executable, "-m", "megatron_rlvr.cli", "--help"])
    with pytest.raises(RuntimeError, match="started a gloo worker group of 2 processes"):
        WorkerGroup(2).run(print)
    assert subprocess.run(["true"]).returncode == 0  # a helper process is fine
