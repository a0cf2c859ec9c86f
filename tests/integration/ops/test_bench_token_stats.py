"""The benchmark tool runs end to end on a tiny shape over two gloo ranks, and its memory accounting sees what it
should: the composite's full-vocabulary temporaries, the out-of-place gradient, and nothing [T, V] for our forward.
An --also implementation is timed beside ours, and the GPU check's summary reads every figure it needs from the
result (so a renamed key fails here, not on the GPU machine)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest

from tools.benches.bench_token_stats import BenchConfig, bench_rank, summarize

pytestmark = pytest.mark.dist
CHECK = Path(__file__).resolve().parents[3] / "tools" / "gpu_check"


def _gpu_check_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_bench_{name}", CHECK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_runs_and_accounts_memory(workers2):
    cfg = BenchConfig(
        tokens=16, vocab=16384, tp=2, top_n=3, dtypes=("float32", "bfloat16"), repeats=1, also=("reference",)
    )
    summary = summarize(workers2.run(bench_rank, cfg), cfg)
    assert summary["also"] == {"reference": "reference"}
    bounds = _gpu_check_module("summary").read_bounds(summary, {"read_gb_per_s": 1.0})
    for dtype_name, fig in summary["by_dtype"].items():
        assert fig["reference_fwd"] > 0 and fig["reference_fwdbwd_inplace_speedup_vs_ours"] > 0
        assert set(bounds[dtype_name]) == {"read_once_s", "floor_over_read_bound", "ours", "reference"}
        assert bounds[dtype_name]["reference"]["fwd_over_read_bound"] > 0
    with contextlib.redirect_stdout(io.StringIO()) as table:
        _gpu_check_module("table").print_ops({"op_bench": summary, "op_bench_vs_bytes_read": bounds})
    assert "op float32 reference over cpp" in table.getvalue()
    for dtype_name, fig in summary["by_dtype"].items():
        logits_bytes = fig["logits_bytes"]
        assert logits_bytes == 16 * 8192 * (4 if dtype_name == "float32" else 2)
        assert fig["ours_fwd_peak_extra_bytes"] < 0.1 * logits_bytes, fig  # records only, no [T, V/tp] buffer
        assert fig["ours_fwdbwd_inplace_peak_extra_bytes"] < 0.1 * logits_bytes, fig
        assert fig["ours_fwdbwd_peak_extra_bytes"] >= logits_bytes, fig  # the out-of-place gradient is counted
        assert fig["composite_fwd_peak_extra_bytes"] >= 2 * logits_bytes, fig  # it gathers the full vocabulary
        assert all(fig[k] > 0 for k in ("floor_logsumexp", "ours_fwd", "composite_fwdbwd"))
