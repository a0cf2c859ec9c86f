"""The CUDA kernels compile for H100/H200 (sm_90) wherever nvcc exists, even on machines without a GPU, and the vector
kernels keep their per-thread state (the online softmax, the top-N list) in registers: ptxas reports no stack frame
and no spill for any of them.

Each csrc/*.cu file is compiled on its own (in parallel) with the flags setup.py gives nvcc. A compile depends only
on nvcc's version, the flags and the sources, so its ptxas report is cached under ~/.cache/megatron-rlvr/nvcc (or
$XDG_CACHE_HOME) by their hash: a rerun with nothing changed reads the report instead of compiling again
(MEGATRON_RLVR_NVCC_CACHE=0 compiles anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CSRC = REPO / "csrc"
NVCC = shutil.which("nvcc")
# setup.py's nvcc flags and those torch's CUDAExtension adds (no implicit half/bf16 conversions), plus the clusters'
# architecture and ptxas's per-kernel report
TORCH_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
FLAGS = [
    "-arch=sm_90",
    "-std=c++17",
    "-O3",
    "--use_fast_math",
    "-DWITH_CUDA",
    *TORCH_FLAGS,
    f"-I{CSRC}",
    "-Xptxas",
    "-v",
]


def _cache_dir() -> Path | None:
    if os.environ.get("MEGATRON_RLVR_NVCC_CACHE") == "0":
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "megatron-rlvr" / "nvcc"


def _key(source: Path, version: str) -> str:
    flags = [f for f in FLAGS if not f.startswith("-I")]  # not the checkout's path: worktrees share the cache
    h = hashlib.sha256(version.encode() + json.dumps(flags).encode() + source.name.encode())
    for path in sorted(CSRC.glob("*.h")) + sorted(CSRC.glob("*.cuh")) + [source]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:32]


def _compile_all(tmp_path: Path) -> dict[str, str]:
    """{source name: ptxas report (nvcc's stderr)}, compiling what the cache does not hold; fails on an error."""
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    cache = _cache_dir()
    reports, running = {}, {}
    for source in sorted(CSRC.glob("*.cu")):
        cached = cache / f"{source.stem}-{_key(source, version)}.txt" if cache else None
        if cached is not None and cached.is_file():
            reports[source.name] = cached.read_text()
            continue
        cmd = [NVCC, *FLAGS, "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")]
        running[source.name] = (cmd, cached, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for name, (cmd, cached, proc) in running.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{out.decode()}\n{err.decode()}"
        reports[name] = err.decode()
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(reports[name])
            tmp.replace(cached)
    return reports


def kernel_frames(report: str) -> dict[str, tuple[int, int]]:
    """{mangled kernel name: (stack frame bytes, spill store bytes)} from ptxas -v output."""
    found = {}
    pattern = r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores"
    for name, frame, spill in re.findall(pattern, report):
        found[name] = (int(frame), int(spill))
    return found


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cuda_sources_compile_for_sm90_with_vector_state_in_registers(tmp_path):
    reports = _compile_all(tmp_path)
    assert set(reports) == {"token_stats_cuda.cu", "token_stats_cuda_vector.cu"}, sorted(reports)
    vector = kernel_frames(reports["token_stats_cuda_vector.cu"])
    # forward: float and bf16 for 5 list sizes; backward: float and bf16, each vector-wide and one element wide
    assert sum("forward_kernel" in k for k in vector) == 10 and sum("backward_kernel" in k for k in vector) == 4, vector
    in_memory = {k: v for k, v in vector.items() if v != (0, 0)}
    assert not in_memory, f"vector kernels with a stack frame or spills (state left registers): {in_memory}"
