"""Detached token selections the losses share: the per-response high-entropy mask, the top-covariance tokens and
CaSP's adaptive candidate sets.

All are functions of statistics that every TP rank holds identically (the fused op all-gathers its per-token
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


def adaptive_candidates(topn_logp: Tensor, mass: float) -> Tensor:
    """CaSP's adaptive candidate set C_t: bool [..., N] over the top-N columns (sorted by probability), True for the
    smallest top-ranked prefix whose probabilities reach ``mass``, at most all N.

    Rank k is in C_t iff ranks 1..k-1 hold less than ``mass``: rank 1 always is (mass > 0), and a prefix reaching
    ``mass`` exactly stops there ("reach" is >=). Equal probabilities need no rule of their own: the op's ranking
    already orders ties by token id. The sums run in float64 on the detached probabilities. ``mass >= 1`` keeps
    every column: the rest of the vocabulary always holds some probability, so a float sum rounding to 1 must not
    cut the set (this is what makes ``candidate_mass = 1`` the fixed top-N exactly).
    """
    if mass >= 1:
        return torch.ones_like(topn_logp, dtype=torch.bool)
    probs = topn_logp.detach().to(torch.float64).exp()
    before = torch.zeros_like(probs)  # the mass of the higher ranks
    before[..., 1:] = torch.cumsum(probs[..., :-1], dim=-1)
    inside = before < mass
    inside[..., 0] = True  # rank 1 even if its column were NaN: the set is never empty
    return inside
