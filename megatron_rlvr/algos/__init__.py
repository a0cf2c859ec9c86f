"""Advantages and policy losses (GRPO, CaSP and the paper's baselines) computed on per-token statistics only.

``compute_advantages(rewards, group_size, cfg) -> (advantages [B], keep [B])``,
``policy_loss(stats, old_logp, advantages, mask, cfg, ...) -> (loss, metrics)`` and PBA's per-response KL
coefficients ``sequence_kl_coef(base_correct, group_size, cfg)``; see docs/algorithms.md for the math.
"""

from megatron_rlvr.algos.advantages import compute_advantages
from megatron_rlvr.algos.config import LOSS_NAMES, AlgoConfig
from megatron_rlvr.algos.losses import LOSSES, policy_loss
from megatron_rlvr.algos.pba import pba_metrics, sequence_kl_coef

__all__ = ["AlgoConfig", "LOSS_NAMES", "LOSSES", "compute_advantages", "pba_metrics", "policy_loss", "sequence_kl_coef"]
