"""The two sources of TokenStats the loss tests run on: the dense float64 oracle and the fused op (TP = 1)."""

from __future__ import annotations

from megatron_rlvr.ops import vocab_parallel_token_stats
from tests.support.algos.dense_reference import dense_token_stats


def op_token_stats(logits, targets, top_n, temperature=1.0):
    return vocab_parallel_token_stats(logits, targets, top_n, temperature=temperature)


PROVIDERS = {"dense": dense_token_stats, "op": op_token_stats}
