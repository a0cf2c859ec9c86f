"""Advantages and policy losses (GRPO, CaSP and the paper's baselines) computed on per-token statistics only.

``compute_advantages(rewards, group_size, cfg) -> (advantages [B], keep [B])`` and
``policy_loss(stats, old_logp, advantages, mask, cfg, ...) -> (loss, metrics)``; see ALGORITHMS.md for the math.
"""

from megatron_rlvr.algos.advantages import compute_advantages
from megatron_rlvr.algos.config import LOSS_NAMES, AlgoConfig
from megatron_rlvr.algos.losses import LOSSES, policy_loss

__all__ = ["AlgoConfig", "LOSS_NAMES", "LOSSES", "compute_advantages", "policy_loss"]
