"""ARMOR's mixed ratio (docs/algorithms.md, "ARMOR"): the policy and its behaviour each mixed with the reference.

``r_mix = (a pi_theta + (1 - a) pi_ref) / (a pi_old + (1 - a) pi_ref)`` per token, with ``a`` the on-policy share of
the batch (`AlgoConfig.mixed_ratio_share`). ``mixed_log_probs`` returns the two mixed log-probabilities, computed in log
space with logsumexp; ``policy_loss`` takes their difference as every loss's log-ratio and the first as the target
whose gradient the weight multiplies, so the mixed ratio composes with every loss. At ``a = 1`` the mixture weights
are ``(1, 0)``: ``log(1) + logp`` and ``-inf + ref_logp`` give back ``logp`` and ``old_logp`` bit for bit, and the
gradient through logsumexp is exactly that of ``logp``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def mixed_log_probs(logp: Tensor, old_logp: Tensor, ref_logp: Tensor, share: float) -> tuple[Tensor, Tensor]:
    """``(log(a pi_theta + (1 - a) pi_ref), log(a pi_old + (1 - a) pi_ref))`` per token, ``a = share`` in (0, 1].
    The gradient flows through ``logp`` only (``old_logp`` and ``ref_logp`` are detached)."""
    if not 0 < share <= 1:
        raise ValueError(f"algo.armor.mixed_ratio_share: expected a share in (0, 1], got {share!r}")
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp: expected shape {tuple(logp.shape)} like stats.logp, got {tuple(ref_logp.shape)}")
    log_a = math.log(share)
    log_rest = math.log1p(-share) if share < 1 else -math.inf  # log(1 - a); a = 1 weights the reference by 0
    ref = ref_logp.detach().to(logp.dtype) + log_rest

    def mix(log_policy: Tensor) -> Tensor:
        return torch.logsumexp(torch.stack([log_policy + log_a, ref]), dim=0)

    return mix(logp), mix(old_logp.detach().to(logp.dtype))


def on_policy_share(group_size: int, anchors: int = 1) -> float:
    """ARMOR's ``a``: the share of a group's ``group_size`` responses that the policy sampled (the rest are anchors)."""
    if not 0 <= anchors < group_size:
        raise ValueError(f"group_size: expected more than {anchors} response(s) per group, got {group_size}")
    return (group_size - anchors) / group_size
