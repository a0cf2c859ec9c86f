"""Detached token selections the losses share: the per-response high-entropy mask and the top-covariance tokens.

Both are functions of statistics that every TP rank holds identically (the fused op all-gathers its per-token
records), so every TP rank selects the same tokens without communicating.
"""

from __future__ import annotations

import torch
from torch import Tensor


def high_entropy_mask(entropy: Tensor, mask: Tensor, tau_q: float) -> Tensor:
    """``h[t] = entropy[t] > quantile_tau_q(entropy over the response tokens of the same row)``, bool [B, T].

    The quantile is torch.quantile's linear interpolation, computed per row over the tokens ``mask`` marks (a row is
    one response, so a micro-batch of whole responses gives the same mask as the full batch). ``tau_q == 0`` selects
    every response token (the strict ``>`` would otherwise drop each row's minimum).
    """
    if tau_q == 0:
        return mask.clone()
    ent = entropy.detach()
    # Padding sorts last, so the first n_b sorted entries of row b are its response tokens.
    ordered = torch.where(mask, ent, torch.full_like(ent, float("inf"))).sort(dim=-1).values
    count = mask.sum(dim=-1)
    rank = tau_q * (count - 1).clamp(min=0).to(ent.dtype)
    below = rank.to(torch.long)
    above = rank.ceil().to(torch.long)
    threshold = torch.lerp(
        ordered.gather(-1, below[:, None]), ordered.gather(-1, above[:, None]), (rank - below.to(ent.dtype))[:, None]
    )
    return (ent > threshold) & mask


def top_covariance_mask(logp: Tensor, advantages: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """The ``fraction`` of response tokens (at least one) with the largest ``(logp - mean logp) * (A - mean A)``.

    Means are over the response tokens of this call (Cui et al. 2025's batch covariance; under micro-batching the
    batch is the micro-batch). Returns bool [B, T]; no token when there are no response tokens or fraction is 0.
    """
    selected = torch.zeros_like(mask)
    count = int(mask.sum())
    if count == 0 or fraction == 0:
        return selected
    lp = logp.detach()[mask].to(torch.float64)
    adv = advantages.detach()[mask].to(torch.float64)
    covariance = (lp - lp.mean()) * (adv - adv.mean())
    k = max(1, int(count * fraction))
    chosen = torch.topk(covariance, k, largest=True, sorted=False).indices
    flat = selected[mask]
    flat[chosen] = True
    selected[mask] = flat
    return selected
