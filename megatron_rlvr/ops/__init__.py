"""Vocab-parallel per-token statistics (log-prob of the sampled token, entropy, top-N candidates) for the losses.

`vocab_parallel_token_stats` is the one entry point (token_stats.py); `reference` holds the pure-torch oracle and
fallback; `backends` picks the CUDA / C++ / torch implementation; `records` is the per-shard record and its merge.
"""

from megatron_rlvr.ops import reference
from megatron_rlvr.ops.token_stats import TokenStats, vocab_parallel_token_stats

__all__ = ["TokenStats", "reference", "vocab_parallel_token_stats"]
