"""The CUDA kernels compile for H100/H200 (sm_90) wherever nvcc exists, even on machines without a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_source_compiles_for_sm90(tmp_path):
    # the same flags setup.py gives nvcc, plus the target architecture of the H200 clusters
    cmd = [
        "nvcc",
        "-arch=sm_90",
        "-std=c++17",
        "-O3",
        "--use_fast_math",
        "-DWITH_CUDA",
        f"-I{REPO / 'csrc'}",
        "-c",
        str(REPO / "csrc" / "token_stats_cuda.cu"),
        "-o",
        str(tmp_path / "token_stats_cuda.o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "token_stats_cuda.o").stat().st_size > 0
