"""The benchmark tool runs end to end on a tiny shape over two gloo ranks, and its memory accounting sees what it
should: the composite's full-vocabulary temporaries, the out-of-place gradient, and nothing [T, V] for our forward."""

from __future__ import annotations

import pytest

from tools.benches.bench_token_stats import BenchConfig, bench_rank, summarize

pytestmark = pytest.mark.dist


def test_bench_runs_and_accounts_memory(workers2):
    cfg = BenchConfig(tokens=16, vocab=16384, tp=2, top_n=3, dtypes=("float32", "bfloat16"), repeats=1)
    summary = summarize(workers2.run(bench_rank, cfg), cfg)
    for dtype_name, fig in summary["by_dtype"].items():
        logits_bytes = fig["logits_bytes"]
        assert logits_bytes == 16 * 8192 * (4 if dtype_name == "float32" else 2)
        assert fig["ours_fwd_peak_extra_bytes"] < 0.1 * logits_bytes, fig  # records only, no [T, V/tp] buffer
        assert fig["ours_fwdbwd_inplace_peak_extra_bytes"] < 0.1 * logits_bytes, fig
        assert fig["ours_fwdbwd_peak_extra_bytes"] >= logits_bytes, fig  # the out-of-place gradient is counted
        assert fig["composite_fwd_peak_extra_bytes"] >= 2 * logits_bytes, fig  # it gathers the full vocabulary
        assert all(fig[k] > 0 for k in ("floor_logsumexp", "ours_fwd", "composite_fwdbwd"))
