"""The per-token record every shard pass writes, the one all-gather that exchanges them, and the merge.

A shard pass (C++, CUDA or the torch reference) summarises its slice of the vocabulary for every token in a float64
record of ``4 + 2N`` numbers; float64 holds token ids exactly, so records need no second tensor and no bit casts:

    [0] m   max of the valid temperature-scaled logits z on this shard (-inf when the shard has none)
    [1] s   sum_j exp(z_j - m)
    [2] a   sum_j exp(z_j - m) * (z_j - m)            (entropy needs sum p*z; this form is shift-invariant)
    [3] zy  the sampled token's z if this shard owns it, else -inf
    [4 : 4+N]      the shard's top-N z values, sorted descending, ties -> lower id; unused slots -inf
    [4+N : 4+2N]   their global ids; unused slots +inf (so they sort after every real id)

One extra row after the T token rows, the header, carries (vocab_start, V_local, n_valid) of the shard, so the merge
can check that the shards tile the vocabulary without another collective. Everything here is small [P, T, R] work;
the [T, V] work is in the shard passes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

M, S, A, ZY = 0, 1, 2, 3
HEADER_FIELDS = 3


def record_width(top_n: int) -> int:
    return 4 + 2 * top_n


def write_header(records: torch.Tensor, vocab_start: int, vocab_local: int, n_valid: int) -> None:
    """Fill the last row of ``records`` [T+1, R] with the shard's place in the vocabulary."""
    records[-1].zero_()
    records[-1, :HEADER_FIELDS] = torch.tensor([vocab_start, vocab_local, n_valid], dtype=records.dtype)


def all_gather_records(records: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The op's only collective: every rank's [T+1, R] records -> [P, T+1, R] in rank order (P = 1 without group)."""
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return records.unsqueeze(0)
    gathered = torch.empty((world,) + tuple(records.shape), dtype=records.dtype, device=records.device)
    dist.all_gather_into_tensor(gathered.view(-1, records.shape[-1]), records, group=group)
    return gathered


class Merged(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    topn_logp: torch.Tensor
    topn_ids: torch.Tensor
    logz: torch.Tensor


def check_layout(gathered: torch.Tensor, target_ids: torch.Tensor, vocab_size: int | None, top_n: int) -> int:
    """Check that the shards tile [0, total) and that every target id is a real token; return the true vocab size.

    One device-to-host copy of a few numbers (the headers and the target range) serves both checks.
    """
    headers = gathered[:, -1, :HEADER_FIELDS].reshape(-1)
    if target_ids.numel():
        bounds = torch.stack([target_ids.min(), target_ids.max()]).to(headers.dtype)
        headers = torch.cat([headers, bounds])
    values = [int(v) for v in headers.tolist()]
    shards = sorted((values[3 * r], values[3 * r + 1], values[3 * r + 2]) for r in range(gathered.shape[0]))
    expected_start = 0
    for start, local, _ in shards:
        if start != expected_start:
            raise ValueError(
                f"vocab_start: the shards must tile the vocabulary [0, V) in slices; got shards (vocab_start, "
                f"V_local) = {[(s, v) for s, v, _ in shards]} (does every TP rank pass its own vocab_start?)"
            )
        expected_start = start + local
    true_vocab = sum(n for _, _, n in shards)
    if vocab_size is not None and true_vocab != vocab_size:
        raise ValueError(
            f"vocab_size: {vocab_size} must be at most the {expected_start} ids the shards hold and the same on "
            f"every rank (the shards count {true_vocab} valid ids)"
        )
    if top_n > true_vocab:
        raise ValueError(f"top_n: {top_n} exceeds the true vocabulary size {true_vocab}")
    if target_ids.numel():
        low, high = values[-2], values[-1]
        if low < 0 or high >= true_vocab:
            raise ValueError(
                f"target_ids: expected ids in [0, {true_vocab}) (the true vocabulary), got values in [{low}, {high}]"
            )
    return true_vocab


def merge_records(gathered: torch.Tensor, top_n: int, out_dtype: torch.dtype) -> Merged:
    """Combine the P shards' records [P, T+1, R] (header row included) into the per-token statistics."""
    rec = gathered[:, :-1, :]
    m, s, a, zy = rec[..., M], rec[..., S], rec[..., A], rec[..., ZY]
    big_m = m.amax(dim=0)
    has_mass = s > 0  # a shard with no valid ids (all padding) has m = -inf and contributes nothing
    shift = torch.where(has_mass, m - big_m, torch.zeros_like(m))
    weight = torch.where(has_mass, torch.exp(shift), torch.zeros_like(m))
    total_s = (weight * s).sum(dim=0)
    total_a = (weight * (a + shift * s)).sum(dim=0)
    log_s = torch.log(total_s)
    logz = big_m + log_s
    entropy = log_s - total_a / total_s
    logp = zy.amax(dim=0) - logz

    num_shards, num_tokens = rec.shape[0], rec.shape[1]
    values = rec[..., 4 : 4 + top_n].permute(1, 0, 2).reshape(num_tokens, num_shards * top_n)
    ids = rec[..., 4 + top_n : 4 + 2 * top_n].permute(1, 0, 2).reshape(num_tokens, num_shards * top_n)
    # Ties go to the lower id: order by id first, then a stable sort by value keeps that order among equals.
    by_id = torch.argsort(ids, dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.argsort(values, dim=-1, descending=True, stable=True)[:, :top_n]
    topn_logp = values.gather(-1, by_value) - logz.unsqueeze(-1)
    topn_ids = ids.gather(-1, by_value).to(torch.int64)
    return Merged(logp.to(out_dtype), entropy.to(out_dtype), topn_logp.to(out_dtype), topn_ids, logz.to(out_dtype))
