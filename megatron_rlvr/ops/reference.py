"""Pure-torch token statistics: the dense oracle the tests trust, and the shard pass used when no kernel is built.

`dense_token_stats` computes the statistics from full-vocabulary logits with plain autograd-tracked torch ops; it
shares no code with the fused path, which is what makes it an oracle. `shard_records` / `shard_backward` implement
the fused op's per-shard contract (see records.py for the record layout) with torch ops, chunked over tokens so
their [chunk, V_local] temporaries stay bounded; the C++ and CUDA kernels implement the same two functions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_rlvr.ops.records import record_width

# Reference temporaries per chunk: about this many elements of [chunk, V_local] (x a few live temporaries).
DEFAULT_CHUNK_ELEMENTS = 1 << 22


class DenseStats(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    topn_logp: torch.Tensor
    topn_ids: torch.Tensor


def accumulate_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed and returned in: float32, or float64 for float64 logits (gradcheck)."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def dense_token_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    top_n: int,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> DenseStats:
    """The oracle: statistics of softmax(logits[..., :vocab_size] / temperature), differentiable via autograd."""
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    z = logits[..., :vocab_size].to(accumulate_dtype(logits.dtype)) / temperature
    logprobs = torch.log_softmax(z, dim=-1)
    probs = logprobs.exp()
    # p log p -> 0 where p = 0 (masked -inf logits); masking log p, not the product, keeps the gradient finite
    entropy = -(probs * torch.where(probs > 0, logprobs, torch.zeros_like(logprobs))).sum(-1)
    logp = logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    # A stable descending sort keeps the lower id first among equal values.
    order = torch.sort(z.detach(), dim=-1, descending=True, stable=True).indices[..., :top_n]
    return DenseStats(logp, entropy, logprobs.gather(-1, order), order)


def _chunk_rows(chunk_tokens: int | None, vocab_local: int) -> int:
    if chunk_tokens is not None:
        return max(1, chunk_tokens)
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_local))


def shard_records(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    records: torch.Tensor,
    *,
    top_n: int,
    vocab_start: int,
    n_valid: int,
    inv_temperature: float,
    chunk_tokens: int | None = None,
) -> None:
    """Write the records [T, 4+2N] (float64) of one shard: logits [T, V_local], valid columns [0, n_valid)."""
    num_tokens = logits.shape[0]
    assert records.shape == (num_tokens, record_width(top_n))
    acc = accumulate_dtype(logits.dtype)
    records[:, 4 : 4 + top_n] = -math.inf
    records[:, 4 + top_n :] = math.inf
    if n_valid == 0:
        records[:, :4] = torch.tensor([-math.inf, 0.0, 0.0, -math.inf], dtype=records.dtype)
        return
    step = _chunk_rows(chunk_tokens, n_valid)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        z = logits[lo:hi, :n_valid].to(acc) * inv_temperature
        m = z.amax(dim=-1)
        safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        shifted = z - safe_m.unsqueeze(-1)
        e = torch.exp(shifted)
        out = records[lo:hi]
        out[:, 0] = m
        out[:, 1] = e.sum(-1)
        out[:, 2] = torch.where(e > 0, e * shifted, torch.zeros_like(e)).sum(-1)
        local = target_ids[lo:hi] - vocab_start
        owned = (local >= 0) & (local < n_valid)
        sampled = z.gather(-1, local.clamp(0, n_valid - 1).unsqueeze(-1)).squeeze(-1)
        out[:, 3] = torch.where(owned, sampled, torch.full_like(sampled, -math.inf))
        k = min(top_n, n_valid)
        if k:
            top = torch.sort(z, dim=-1, descending=True, stable=True)
            out[:, 4 : 4 + k] = top.values[:, :k]
            out[:, 4 + top_n : 4 + top_n + k] = top.indices[:, :k] + vocab_start
        del z, shifted, e


def shard_backward(
    logits: torch.Tensor,
    grad_out: torch.Tensor,
    target_ids: torch.Tensor,
    topn_ids: torch.Tensor,
    logz: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    grad_topn: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    inv_temperature: float,
    chunk_tokens: int | None = None,
) -> None:
    """Write dL/dlogits of one shard into grad_out [T, V_local] (which may be `logits` itself); padding gets 0.

    dL/dz_j = g_logp [j=y] + sum_n g_n [j=c_n] - (g_logp + sum_n g_n) p_j - g_H p_j (log p_j + H), then / T.
    """
    num_tokens, vocab_local = logits.shape
    acc = accumulate_dtype(logits.dtype)
    grad_out[:, n_valid:] = 0
    if n_valid == 0:
        return
    total = grad_logp + grad_topn.sum(-1)
    step = _chunk_rows(chunk_tokens, n_valid)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        logprobs = logits[lo:hi, :n_valid].to(acc) * inv_temperature - logz[lo:hi].unsqueeze(-1)
        probs = torch.exp(logprobs)
        ent_term = torch.where(probs > 0, probs * (logprobs + entropy[lo:hi].unsqueeze(-1)), torch.zeros_like(probs))
        grad = -(total[lo:hi].unsqueeze(-1) * probs) - grad_entropy[lo:hi].unsqueeze(-1) * ent_term
        del logprobs, probs, ent_term
        # the one-hot terms, for ids this shard owns (others add 0 at column 0)
        ids = torch.cat([target_ids[lo:hi].unsqueeze(-1), topn_ids[lo:hi]], dim=-1) - vocab_start
        weights = torch.cat([grad_logp[lo:hi].unsqueeze(-1), grad_topn[lo:hi]], dim=-1).to(acc)
        owned = (ids >= 0) & (ids < n_valid)
        grad.scatter_add_(-1, torch.where(owned, ids, 0), torch.where(owned, weights, 0))
        grad.mul_(inv_temperature)
        grad_out[lo:hi, :n_valid] = grad
        del grad
