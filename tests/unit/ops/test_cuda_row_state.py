"""The vector CUDA kernel's merge logic, run on the CPU: its per-row state (csrc/token_stats_cuda_row.cuh: the
online softmax, the register top-N, the bitonic merge of two lists) is host/device code, so a small C++ driver
(cuda_row_state_check.cpp) compiles that same header with the host compiler and replays the kernel's order (strided
vectors per thread, a warp's xor butterfly, the block's merge) against a sorted reference, with ties, -inf columns
and every misaligned head. What it cannot show (loads, shuffles, shared memory) the GPU tests settle."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "csrc"
COMPILER = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(COMPILER is None, reason="needs a C++ compiler")
def test_vector_kernel_row_state_matches_sorted_reference(tmp_path):
    binary = tmp_path / "row_state_check"
    cmd = [COMPILER, "-std=c++17", "-O2", "-Wall", "-Wno-unknown-pragmas", f"-I{CSRC}"]
    built = subprocess.run(
        cmd + [str(HERE / "cuda_row_state_check.cpp"), "-o", str(binary)], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("ok "), done.stdout[-3000:]
