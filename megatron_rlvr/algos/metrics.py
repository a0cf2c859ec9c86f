"""The metrics every policy loss reports: plain floats averaged over this batch's response tokens.

Names: clip_frac, entropy, high_entropy_frac, rank{k}_prob and rank{k}_prob_high_entropy (k = 1..3, as far as the
statistics hold top-k columns), neg_rank1_frac (negative-sample tokens whose sampled token was rank 1), kl_old (k3
estimate of KL(old || new) on the sampled tokens); with CaSP's adaptive candidates also casp_candidates, the mean
size of C_t over the high-entropy tokens of positive samples (the ones CaSP smooths), and casp_smoothed_tokens, their
count (to combine batches: see SUBSET_MEANS). A mean over no tokens is 0.

Combining: `combine_micro_batches` turns one mini-batch's per-micro-batch dicts into the logged names (``loss/<key>``;
keys that already name their family, such as ``rollout_correction/*``, keep it), and `finish_subset_means` divides
the subset means by their counts once the data-parallel ranks have summed them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron_rlvr.algos.token_view import TokenView


def _mean(values: Tensor, where: Tensor) -> Tensor:
    total = torch.where(where, values, torch.zeros_like(values)).sum()
    return total / where.sum().clamp(min=1).to(values.dtype)


@torch.no_grad()
def loss_metrics(
    view: TokenView, *, log_ratio: Tensor, clipped: Tensor, top_ranks: Tensor, candidates: Tensor | None = None
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


LOSS_TERMS: tuple[str, ...] = (
    "pg_loss",
    "kl_ref",
    "kl_loss",
    "entropy_bonus",
    "cov_penalty",
    "distill_loss",
    "crpo_loss",
)
# Metrics that average over a subset of the tokens, with the metric holding that subset's count: combined over
# micro-batches and ranks by that count (a token-weighted mean would count batches without such tokens as 0).
SUBSET_MEANS: dict[str, str] = {"casp_candidates": "casp_smoothed_tokens"}


def token_weighted_mean(parts: Sequence[Mapping[str, float]], weight_key: str = "num_tokens") -> dict[str, float]:
    """Combine per-micro-batch metric dicts into one, each weighted by its token count (``weight_key``)."""
    if not parts:
        return {}
    weights = [float(p.get(weight_key, 1.0)) for p in parts]
    total = sum(weights)
    out: dict[str, float] = {}
    for key in parts[0]:
        if key == weight_key:
            out[key] = total
            continue
        values = [(float(p[key]), w) for p, w in zip(parts, weights) if key in p]
        wsum = sum(w for _, w in values)
        out[key] = sum(v * w for v, w in values) / wsum if wsum > 0 else 0.0
    return out


def metric_name(key: str) -> str:
    """The logged name of a loss metric: ``loss/<key>``, unless the key already names its family."""
    return key if "/" in key else f"loss/{key}"


def combine_micro_batches(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One mini-batch's loss metrics on this rank from its micro-batches': token-weighted means, loss terms summed
    (each micro-batch's term is already normalised by the mini-batch's global counts), subset means as sums beside
    their counts (see `finish_subset_means`)."""
    if not parts:
        return {}
    out = {metric_name(k): v for k, v in token_weighted_mean(parts).items()}
    out.update({metric_name(k): sum(p[k] for p in parts) for k in LOSS_TERMS if k in parts[0]})
    for key, count in SUBSET_MEANS.items():
        if key in parts[0]:
            out[metric_name(key)] = sum(p[key] * p[count] for p in parts)
            out[metric_name(count)] = sum(p[count] for p in parts)
    return out


def summed_over_data_parallel() -> tuple[str, ...]:
    """The logged names that add up over data-parallel ranks (the rest average)."""
    subsets = [part for pair in SUBSET_MEANS.items() for part in pair]
    return ("actor/loss", metric_name("num_tokens"), *(metric_name(k) for k in (*LOSS_TERMS, *subsets)))


def finish_subset_means(metrics: dict[str, float]) -> dict[str, float]:
    """Divide each subset mean's sum by its count (after the data-parallel sum)."""
    for key, count in SUBSET_MEANS.items():
        if metric_name(key) in metrics:
            metrics[metric_name(key)] /= max(metrics[metric_name(count)], 1.0)
    return metrics


def logp_mismatch(engine_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> float:
    """The train/inference mismatch: the mean |engine log-prob - actor log-prob| of the sampled tokens over the
    trained positions ``mask`` [B, T] (0 without any)."""
    return float(((engine_logp - behaviour_logp).abs() * mask).sum() / mask.sum().clamp_min(1))
