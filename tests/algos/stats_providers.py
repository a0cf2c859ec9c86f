"""The two sources of TokenStats the loss tests run on: the dense float64 oracle and the fused op (TP = 1)."""

from __future__ import annotations

import pytest

from tests.algos.dense_reference import dense_token_stats


def op_token_stats(logits, targets, top_n, temperature=1.0):
    ops = pytest.importorskip("megatron_rlvr.ops", reason="the fused statistics op has not landed")
    if not hasattr(ops, "vocab_parallel_token_stats"):
        pytest.skip("megatron_rlvr.ops.vocab_parallel_token_stats has not landed")
    return ops.vocab_parallel_token_stats(logits, targets, top_n, temperature=temperature)


PROVIDERS = {"dense": dense_token_stats, "op": op_token_stats}
