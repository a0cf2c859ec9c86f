"""The metrics every policy loss reports: plain floats averaged over this batch's response tokens.

Names: clip_frac, entropy, high_entropy_frac, rank{k}_prob and rank{k}_prob_high_entropy (k = 1..3, as far as the
statistics hold top-k columns), neg_rank1_frac (negative-sample tokens whose sampled token was rank 1), kl_old (k3
estimate of KL(old || new) on the sampled tokens); with CaSP's adaptive candidates also casp_candidates, the mean
size of C_t over the high-entropy tokens of positive samples (the ones CaSP smooths), and casp_smoothed_tokens, their
count (to combine batches: see losses.SUBSET_MEANS). A mean over no tokens is 0. Averaging over micro-batches is the
caller's: weight each by its ``num_tokens`` metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron_rlvr.algos.losses import TokenView


def _mean(values: Tensor, where: Tensor) -> Tensor:
    total = torch.where(where, values, torch.zeros_like(values)).sum()
    return total / where.sum().clamp(min=1).to(values.dtype)


@torch.no_grad()
def loss_metrics(
    view: "TokenView", *, log_ratio: Tensor, clipped: Tensor, top_ranks: Tensor, candidates: Tensor | None = None
) -> dict[str, float]:
    mask, high = view.mask, view.high_entropy
    log_ratio = log_ratio.detach()
    rho = log_ratio.exp()
    entropy = view.entropy.detach()
    values = {
        "clip_frac": _mean(clipped.to(rho.dtype), mask),
        "entropy": _mean(entropy, mask),
        "entropy_high_entropy": _mean(entropy, high),
        "high_entropy_frac": _mean(high.to(rho.dtype), mask),
        "neg_rank1_frac": _mean(view.is_top1.to(rho.dtype), view.negative),
        "kl_old": _mean(rho - 1 - log_ratio, mask),
    }
    probs = top_ranks.detach()[..., :3].exp().to(rho.dtype)
    for k in range(probs.shape[-1]):
        values[f"rank{k + 1}_prob"] = _mean(probs[..., k], mask)
        values[f"rank{k + 1}_prob_high_entropy"] = _mean(probs[..., k], high)
    if candidates is not None:
        smoothed = view.positive & high
        values["casp_candidates"] = _mean(candidates.sum(dim=-1).to(rho.dtype), smoothed)
        values["casp_smoothed_tokens"] = smoothed.sum().to(rho.dtype)
    # One device-to-host copy for all of them (each float() would be a separate sync on GPU).
    return dict(zip(values, torch.stack(list(values.values())).tolist()))
