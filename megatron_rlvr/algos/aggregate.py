"""Reduce a per-token loss [B, T] to a scalar by ``loss_agg``, with global normalizers so micro-batches add up.

With ``num_tokens`` / ``num_seqs`` the counts of the whole mini-batch, the sum of the micro-batches' aggregates is
exactly the mini-batch's aggregate in every mode (every mode is a sum of per-row terms over a global constant).
"""

from __future__ import annotations

import torch
from torch import Tensor


def response_counts(mask: Tensor) -> tuple[float, float]:
    """(response tokens, responses with at least one token) of this batch: the default normalizers."""
    return float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())


def aggregate(
    values: Tensor, mask: Tensor, loss_agg: str, *, num_tokens: float, num_seqs: float, max_len_norm: int
) -> Tensor:
    """``token_mean``: sum / num_tokens. ``seq_mean_token_mean``: sum over rows of the row's token mean, / num_seqs.
    ``seq_mean_token_sum_norm`` (Dr.GRPO): sum / max_len_norm / num_seqs. Zero normalizers give a zero loss.
    """
    # where (not multiply) so that garbage in padded positions (NaN, inf) never reaches the value or the gradient.
    masked = torch.where(mask, values, torch.zeros_like(values))
    if loss_agg == "token_mean":
        return masked.sum() / max(num_tokens, 1.0)
    if loss_agg == "seq_mean_token_mean":
        row_means = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(values.dtype)
        return row_means.sum() / max(num_seqs, 1.0)
    if loss_agg == "seq_mean_token_sum_norm":
        return masked.sum() / float(max_len_norm) / max(num_seqs, 1.0)
    raise ValueError(
        f"algo.loss.agg: got {loss_agg!r}; allowed values: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"
    )
