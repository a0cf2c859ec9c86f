"""Advantages: group-relative (GRPO std-normalized, Dr.GRPO mean-centred only) or the raw reward (the SFT-to-RL grid's
REINFORCE without a baseline), and uniform-group filtering."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


def compute_advantages(rewards: Tensor, group_size: int, cfg: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Per-response advantages ``A_i = (r_i - mean_g r) / (std_g r + eps)`` (no division when not normalize_std).

    ``rewards`` is [B] with B = prompts * group_size, each prompt's group contiguous. The group std is the unbiased
    (Bessel-corrected) one, as in the GRPO reference implementations; a group of one response has std 0.
    ``cfg.advantage.kind`` other than ``group`` takes no group statistics (docs/algorithms.md, "The SFT-to-RL grid"):
    ``reward`` is ``A_i = r_i`` and ``signed_reward`` is ``A_i = 2 r_i - 1``, in every group, uniform ones included.
    Returns ``(advantages [B] float32, keep [B] bool)``: keep is False for every response of a group whose rewards
    are all equal when ``cfg.drop_uniform_groups`` (such groups carry no signal: the caller refills or drops them),
    and True everywhere otherwise. Under ``group`` a uniform group's advantages are exactly 0 either way.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(
            f"rewards: expected a 1-D tensor [prompts * group_size], got {getattr(rewards, 'shape', rewards)}"
        )
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size: expected a positive divisor of the number of rewards {rewards.numel()}, got {group_size}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards: expected finite values, got NaN or inf")
    groups = rewards.detach().to(torch.float64).view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    centred = groups - mean
    # Uniform groups are detected on the raw rewards so that float noise in the mean cannot make them non-zero.
    uniform = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    if cfg.advantage.normalize_std:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        centred = centred / (std + cfg.advantage.eps)
    advantages = torch.where(uniform, torch.zeros_like(centred), centred)
    if cfg.advantage.kind == "reward":
        advantages = groups
    elif cfg.advantage.kind == "signed_reward":
        advantages = 2 * groups - 1
    if cfg.drop_uniform_groups:
        keep = ~uniform.expand_as(groups)
    else:
        keep = torch.ones_like(groups, dtype=torch.bool)
    return advantages.reshape(-1).to(torch.float32), keep.reshape(-1)
