"""`TokenView`: what a loss's shaping and its metrics may read, the per-token statistics and the inputs broadcast to
[B, T]. The losses build one per micro-batch (losses.py); the metrics read it (metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


@dataclass
class TokenView:
    """What a loss's shaping may read: the statistics and inputs broadcast to [B, T] (top-N cut to cfg.loss.top_n)."""

    logp: Tensor
    old_logp: Tensor
    entropy: Tensor
    topn_logp: Tensor  # [B, T, top_n]
    is_top1: Tensor  # bool: the sampled token is the rank-1 candidate
    advantages: Tensor  # A_i broadcast over the response's tokens
    mask: Tensor  # bool: response tokens
    high_entropy: Tensor  # bool: h[t], per-response quantile tau_q
    positive: Tensor  # bool: response token of a sample with A_i > 0
    negative: Tensor  # bool: response token of a sample with A_i < 0
    cfg: AlgoConfig
