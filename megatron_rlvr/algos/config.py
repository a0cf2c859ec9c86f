"""Configuration of advantages and the policy loss (see shared ALGORITHMS.md for every knob's meaning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossName = Literal[
    "grpo", "casp", "entropy_bonus", "entropy_adv", "kl_cov", "clip_cov", "w_reinforce", "psr", "nsr", "forking_tokens"
]


@dataclass
class AlgoConfig:
    loss: LossName = "casp"
    # advantages
    normalize_std: bool = True  # false = Dr.GRPO
    adv_eps: float = 1e-6
    drop_uniform_groups: bool = False
    # PPO clip and aggregation
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    max_len_norm: int = 1024  # the constant of seq_mean_token_sum_norm
    kl_coef: float = 0.0  # k3 KL to a frozen reference; 0 = no reference model
    # CaSP
    top_n: int = 3
    alpha: float = 0.05
    lambda_top1: float = 0.5
    tau_q: float = 0.8
    weights: Literal["uniform", "softmax"] = "uniform"
    apply_to: Literal["both", "positive", "negative"] = "both"
    # baselines
    beta: float = 0.01  # entropy_bonus / entropy_adv / kl_cov coefficient
    kappa: float = 2.0  # entropy_adv cap |A| / kappa
    cov_fraction: float = 0.002  # kl_cov / clip_cov: fraction k of tokens selected
    lambda_pos: float = 0.1  # w_reinforce
