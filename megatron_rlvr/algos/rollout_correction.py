"""Rollout correction: the engine that sampled a response (vLLM, its own kernels and numerics) is not exactly the
policy that trains on it, so each sampled token's policy-gradient weight is reweighted by the ratio of the two.

``rho_t = exp(old_logp[t] - rollout_logp[t])``: the actor's behaviour log-prob of the sampled token over the
engine's (docs/algorithms.md, "Rollout correction"). The correction ``c`` is a detached per-token factor of ``w``:
- ``tis``    token: ``min(rho_t, C)``;                 sequence: ``min(prod_t rho_t, C)`` on all of its tokens.
- ``icepop`` token: ``rho_t * [lo <= rho_t <= hi]``;   sequence: ``g * [lo <= g <= hi]``, g the geometric mean of rho.
- ``mis``    token: ``[lo <= rho_t <= hi]``;           sequence: ``[lo <= g <= hi]``.
The config requires ``C >= 1`` and ``lo <= 1 <= hi``, so where the engine agrees with the actor (rho = 1 exactly)
every correction is exactly 1: the identity. Products over a response are sums of log-ratios (no underflow); a
ratio that overflows to inf is truncated to C (tis) or falls outside the band (mis, icepop), never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig

WEIGHT_MEAN = "rollout_correction/weight_mean"
CLIPPED_FRAC = "rollout_correction/clipped_frac"  # tis: tokens whose weight was truncated to C
MASKED_FRAC = "rollout_correction/masked_frac"  # mis / icepop: tokens whose weight was set to 0


def correction_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(c [B, T] detached, metrics)`` for ``cfg.rollout_correction.kind`` at ``cfg.rollout_correction.level``.

    ``old_logp`` / ``rollout_logp`` [B, T] hold the actor's and the engine's log-probs of the sampled tokens;
    ``mask`` (bool [B, T]) marks response tokens. ``c`` is 1 outside the mask. The metrics are 0-d tensors, means
    over the response tokens: the weight's mean and the truncated (tis) or masked (mis, icepop) fraction.
    """
    kind, level = cfg.rollout_correction.kind, cfg.rollout_correction.level
    if kind == "none":
        raise ValueError("correction_weights: algo.rollout_correction.kind is 'none'; there is nothing to compute")
    old_logp, rollout_logp = old_logp.detach(), rollout_logp.detach().to(old_logp.dtype)
    zero = torch.zeros_like(old_logp)
    log_rho = torch.where(mask, old_logp - rollout_logp, zero)
    if level == "token":
        log_ratio = log_rho
    elif kind == "tis":  # the sequence's importance ratio: the product over its tokens
        log_ratio = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
    else:  # mis / icepop: the geometric mean, so the band means the same at any response length
        count = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
        log_ratio = (log_rho.sum(dim=-1, keepdim=True) / count).expand_as(log_rho)
    ratio = torch.exp(log_ratio)
    if kind == "tis":
        weight = ratio.clamp(max=cfg.rollout_correction.cap)
        dropped, dropped_key = ratio > cfg.rollout_correction.cap, CLIPPED_FRAC
    elif kind in ("mis", "icepop"):
        inside = (ratio >= cfg.rollout_correction.low) & (ratio <= cfg.rollout_correction.high)
        kept = ratio if kind == "icepop" else torch.ones_like(ratio)
        weight = torch.where(inside, kept, zero)  # where, not a product: inf * 0 would be NaN
        dropped, dropped_key = ~inside, MASKED_FRAC
    else:
        raise ValueError(f"algo.rollout_correction.kind: got {kind!r}; allowed values: none, tis, mis, icepop")
    weight = torch.where(mask, weight, torch.ones_like(weight)).detach()
    tokens = mask.sum().clamp(min=1).to(weight.dtype)
    metrics = {
        WEIGHT_MEAN: torch.where(mask, weight, zero).sum() / tokens,
        dropped_key: (dropped & mask).sum().to(weight.dtype) / tokens,
    }
    return weight, metrics
