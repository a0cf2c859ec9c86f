"""tools/gpu_check.sh stays runnable on the GPU machine without one here: its dry run parses every script's arguments
and imports what each stage will import; a broken import or argument fails it; the carried wheels' tags fit the
device's python 3.12 (the lock is checked in a clean clone, where the git-ignored .whl/ does not exist)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CHECK = REPO / "tools" / "gpu_check"

pytestmark = pytest.mark.small  # a dry run: imports and argument parsing (tests/parallel.py)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_test_{name}", CHECK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORK": str(tmp_path / "work"), "OMP_NUM_THREADS": "1"}


def test_dry_run_of_the_whole_check(tmp_path):
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--dry-run"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = ("actor_small_cpu", "op_bench", "actor_1b", "actor_1b_unfused", "actor_small_cuda_fp32sum")
    stages += ("actor_lora_cpu", "actor_lora_cuda", "actor_reference_cuda", "actor_compare_reference", "bridge")
    for stage in stages + ("summary",):
        assert f"dry run: {stage}: " in done.stdout, done.stdout
    assert "dry run ok" in done.stdout
    if not (REPO / ".whl").is_dir():  # a clean clone: the presence check is skipped, and says why
        assert "tools/gpu_wheels.sh" in done.stdout


def test_usage_error(tmp_path):
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--bogus"],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "usage" in done.stderr


def _dry_run(tmp_path: Path, *invocations: str) -> subprocess.CompletedProcess:
    listing = tmp_path / "dry_run.txt"
    listing.write_text("".join(line + "\n" for line in invocations))
    return subprocess.run(
        [sys.executable, str(CHECK / "dry_run.py"), str(listing)],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


SCRIPT = """
import argparse
{imports}

def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    return p

def preflight(args):
    return []
"""


@pytest.mark.parametrize(
    "imports,args,expected",
    [
        ("", "--out\tx.json", None),
        ("import no_such_module_for_gpu_check", "--out\tx.json", "ModuleNotFoundError"),
        ("", "--outt\tx.json", "exit 2"),  # the parser refuses an argument gpu_check.sh passes
        ("import vllm", "--out\tx.json", "neither on the device image nor in wheels.lock"),
    ],
)
def test_dry_run_fails_on_a_broken_script(tmp_path, imports, args, expected):
    script = tmp_path / "stage_script.py"
    script.write_text(SCRIPT.format(imports=imports if "vllm" not in imports else "def _later():\n    " + imports))
    done = _dry_run(tmp_path, f"stage\t{script}\t{args}")
    if expected is None:
        assert done.returncode == 0, done.stderr
        assert "dry run ok" in done.stdout
    else:
        assert done.returncode == 1, done.stdout
        assert expected in done.stderr, done.stderr


def test_dry_run_refuses_a_bad_layout(tmp_path):
    done = _dry_run(tmp_path, "actor\ttools/gpu_check/actor_check.py\t--layouts\tpadded,bogus\t--out\tx\t--tensors\ty")
    assert done.returncode == 1 and "--layouts: unknown 'bogus'" in done.stderr, done.stderr


def test_wheel_tags_for_the_device():
    wheels = _module("wheels")
    assert wheels.check_tags([e.file for e in wheels.read_lock()]) == []  # what gpu_wheels.sh fetches
    assert wheels.check_tags(["einops-0.8.1-py3-none-any.whl", "x-1.0-cp312-abi3-manylinux_2_17_x86_64.whl"]) == []
    for bad in (
        "megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl",  # another python
        "x-1.0-cp312-cp312-manylinux_2_40_x86_64.whl",  # a newer glibc than the image's
        "x-1.0-cp312-cp312-macosx_11_0_arm64.whl",
    ):
        assert len(wheels.check_tags([bad])) == 1, bad
    two = wheels.check_tags(["einops-0.8.1-py3-none-any.whl", "einops-0.8.2-py3-none-any.whl"])
    assert len(two) == 1 and "2 versions" in two[0]


def _wheel(path: Path, requires: list[str]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        meta = "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr("pkg-1.0.dist-info/METADATA", meta)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_wheel_folder_against_the_lock(tmp_path):
    wheels = _module("wheels")
    name = "pkg-1.0-py3-none-any.whl"
    digest = _wheel(tmp_path / name, ["torch>=2", "numpy", "wandb; extra == 'mlm'"])
    assert wheels.check_dir(tmp_path, [wheels.Locked("pkg==1.0", name, digest)]) == []
    wrong = wheels.check_dir(tmp_path, [wheels.Locked("pkg==1.0", name, "0" * 64)])
    assert len(wrong) == 1 and "sha256" in wrong[0]
    digest = _wheel(tmp_path / name, ["nvidia-modelopt"])  # a run-time need the device lacks
    needs = wheels.check_dir(tmp_path, [wheels.Locked("pkg==1.0", name, digest)])
    assert len(needs) == 1 and "nvidia-modelopt" in needs[0]
    (tmp_path / "stale-0.1-py3-none-any.whl").write_bytes(b"")
    missing = wheels.check_dir(tmp_path, [wheels.Locked("other==1", "other-1-py3-none-any.whl", "0" * 64)])
    assert any("missing" in m for m in missing) and any("not in wheels.lock" in m for m in missing)
