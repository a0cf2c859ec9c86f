"""The fixed probe's per-position statistics from vocab-sharded logits: what the CaSP mechanism study measures at
every teacher-forced position of the probe set (docs/casp-mechanism.md).

``position_stats(logits, targets, ks, group=..., vocab_start=..., vocab_size=..., temperature=...)`` returns, per
position, over softmax(logits / temperature) restricted to the true vocabulary:

- ``logp``: the log-probability of the given next token (the base's response token);
- ``entropy``;
- ``top_prob`` [..., 3]: the rank-1, rank-2 and rank-3 probabilities (the fused op's top-N, ties to the lower id);
- ``distinct`` [..., len(ks)]: the expected number of distinct tokens in K independent draws from the position's
  distribution, ``E_K = sum_v 1 - (1 - p_v)^K`` (the CaSP paper's appendix B.2), for each K of ``ks``.

The first three come from the fused op (`ops.vocab_parallel_token_stats`: one streaming pass per shard and one
all-gather of small records over the TP group). ``E_K`` needs every probability, which the op's top-N does not give:
it is summed over each rank's own shard and added up with one all-reduce over TP. Its normaliser comes from the op
too: ``log Z = z_top1 / T - log p_top1``, where only the rank that holds the top-1 id knows ``z_top1``, so that
logit travels in a second, [T]-sized all-reduce. Nothing [T, V]-sized crosses ranks, and the [T, V_local]
temporaries are cut into row chunks of about ``scratch_bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rlvr.ops import vocab_parallel_token_stats

PROBE_TOP_N = 3  # CaSP's N: rank-1..3 probabilities, the top-3 mass and the rank-3 share (appendix D.2)
DEFAULT_SCRATCH_BYTES = 1 << 28  # the float64 [rows, V_local] temporaries of one chunk of E_K


class PositionStats(NamedTuple):
    """Per-position statistics; ``logp`` / ``entropy`` [...], ``top_prob`` [..., 3], ``distinct`` [..., len(ks)]."""

    logp: torch.Tensor
    entropy: torch.Tensor
    top_prob: torch.Tensor
    distinct: torch.Tensor


def field_names(ks: Sequence[int]) -> list[str]:
    """The per-position rows of a scored batch (`probe_scoring.ProbeScorer.score`), in order."""
    return ["logp", "entropy", "rank1", "rank2", "rank3", *(f"distinct@{k}" for k in ks)]


def check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    """The draw counts K of ``E_K``: distinct integers >= 1, or a ValueError naming the bad one."""
    out = tuple(ks)
    for k in out:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ks: expected integers >= 1 (draws per position), got {k!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"ks: expected distinct values, got {list(out)}")
    return out


@torch.no_grad()
def expected_distinct(
    logits: torch.Tensor,
    log_z: torch.Tensor,
    ks: Sequence[int],
    *,
    n_valid: int,
    inv_temperature: float,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> torch.Tensor:
    """This shard's share of ``E_K`` [T, len(ks)] (float64): ``sum_v 1 - (1 - p_v)^K`` over its first ``n_valid``
    columns (the rest are padded ids), with ``p_v = exp(z_v / T - log_z)``. ``1 - (1 - p)^K`` is computed as
    ``-expm1(K log1p(-p))``, which keeps ``K p`` for tiny p and gives 1 at p = 1."""
    rows_total = logits.shape[0]
    out = torch.zeros(rows_total, len(ks), dtype=torch.float64, device=logits.device)
    if n_valid == 0 or rows_total == 0:
        return out
    rows = max(1, scratch_bytes // (8 * n_valid))
    for start in range(0, rows_total, rows):
        end = min(start + rows, rows_total)
        z = logits[start:end, :n_valid].to(torch.float64) * inv_temperature
        log_q = torch.log1p(-torch.exp(z - log_z[start:end, None]).clamp_(max=1.0))  # log(1 - p_v)
        for j, k in enumerate(ks):
            out[start:end, j] = -torch.expm1(log_q * k).sum(dim=1)
    return out


@torch.no_grad()
def position_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ks: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> PositionStats:
    """The probe's statistics at every position of ``logits`` [..., V_local] (this rank's shard of the vocabulary,
    global ids from ``vocab_start``; ids >= ``vocab_size`` are padding), ``targets`` [...] the next tokens. A
    collective over ``group`` (the TP group; None: one process holds the whole vocabulary). float64 out."""
    ks = check_ks(ks)
    stats = vocab_parallel_token_stats(
        logits,
        targets,
        PROBE_TOP_N,
        group=group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    lead = tuple(logits.shape[:-1])
    flat = logits.reshape(-1, logits.shape[-1])
    local = flat.shape[1]
    n_valid = local if vocab_size is None else min(max(vocab_size - vocab_start, 0), local)
    inv_t = 1.0 / float(temperature)
    # log Z from the rank-1 token, whose logit only its owner holds: one [T] all-reduce brings it everywhere
    top1 = stats.topn_ids[..., 0].reshape(-1)
    top1_logp = stats.topn_logp[..., 0].reshape(-1).to(torch.float64)
    owned = (top1 >= vocab_start) & (top1 < vocab_start + n_valid)
    column = (top1 - vocab_start).clamp(0, max(local - 1, 0))
    z_top1 = torch.where(owned, flat.gather(1, column[:, None])[:, 0].to(torch.float64), torch.zeros_like(top1_logp))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(z_top1, group=group)
    log_z = z_top1 * inv_t - top1_logp
    distinct = expected_distinct(flat, log_z, ks, n_valid=n_valid, inv_temperature=inv_t, scratch_bytes=scratch_bytes)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(distinct, group=group)
    return PositionStats(
        stats.logp.to(torch.float64),
        stats.entropy.to(torch.float64),
        stats.topn_logp.to(torch.float64).exp(),
        distinct.view(lead + (len(ks),)),
    )
