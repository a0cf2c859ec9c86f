"""Context-parallel core attention over packed (THD) streams without Transformer Engine (docs/context-parallel.md).

Each CP rank holds chunks r and 2 * cp - 1 - r of every sequence (megatron's load-balanced split; ``cu_seqlens`` are
the whole stream's, every segment a multiple of 2 * cp). K and V are all-gathered over the CP group (autograd-aware:
the backward sums every rank's gradient of the gathered K/V and keeps this rank's slice, so gradients reach their
owner rank), put back into whole-stream order, and each of this rank's query chunks attends to the causal part of
its sequence only: keys from the sequence's start to the chunk's end, masked by true positions. A chunk r of a
sequence thus costs chunk x (r + 1) chunks of scores, not chunk x sequence. Short sequences share one masked call
(up to the attention's ``block_tokens`` tokens of the whole stream) as in the CP = 1 path.

``context_parallel_attention`` is called by ``attention.PackedDotProductAttention`` when cp > 1; no model file knows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

# dense(query [sq, heads, d], key [sk, groups, d], value [sk, groups, d], mask [sq, sk] True = masked) -> [sq, h*d]
Dense = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class _AllGatherSumGrad(torch.autograd.Function):
    """all-gather along dim 0; backward: the gradients of every rank summed, this rank's slice."""

    @staticmethod
    def forward(ctx, values: Tensor, group) -> Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(values) for _ in range(ctx.size)]
        dist.all_gather(parts, values.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        # gloo has no reduce-scatter: all-reduce the whole gradient, keep this rank's slice
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.rank].clone(), None


def local_positions(cu: tuple[int, ...], cp: int, rank: int) -> list[tuple[int, int, int]]:
    """(local start, whole-stream start, length) of each query chunk this rank holds, in its stream's order."""
    pieces, local = [], 0
    for start, end in zip(cu[:-1], cu[1:]):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            pieces.append((local, start + c * chunk, chunk))
            local += chunk
    return pieces


@lru_cache(maxsize=8)  # every layer of a micro-batch's forward and backward reads the same layout
def _whole_stream_order(cu: tuple[int, ...], cp: int) -> Tensor:
    """index such that whole[index] = gathered (every rank's stream, rank after rank), as a permutation."""
    return torch.cat(
        [torch.arange(s, s + n) for r in range(cp) for _, s, n in local_positions(cu, cp, r) if n]
        or [torch.zeros(0, dtype=torch.long)]
    )


def context_parallel_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, group, dense: Dense, block_tokens: int
) -> Tensor:
    """query [T_local, heads, d], key / value [T_local, groups, d] of this CP rank -> [T_local, heads * d]."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = tuple(cu_seqlens.tolist())
    if any((e - s) % (2 * cp) for s, e in zip(cu[:-1], cu[1:])):
        raise ValueError(f"context-parallel attention: every segment must be a multiple of 2 * cp = {2 * cp}")
    if cu[-1] != cp * query.shape[0]:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but {cp} CP ranks hold {cp * query.shape[0]} tokens")
    order = _whole_stream_order(cu, cp).to(query.device)
    kv = _AllGatherSumGrad.apply(torch.cat([key, value], dim=-1), group)
    whole = torch.empty_like(kv)
    whole = whole.index_copy(0, order, kv)  # differentiable: the gradient goes back to the gathered order
    k_whole, v_whole = whole.split([key.shape[-1], value.shape[-1]], dim=-1)
    outputs = []
    for q_start, q_len, k_start, k_end, q_pos, k_pos in _calls(cu, cp, rank, block_tokens):
        dev = query.device
        qp, kp = q_pos.to(dev), k_pos.to(dev)
        # True = masked: another sequence (segment id) or a later position
        mask = (qp[:, None, 0] != kp[None, :, 0]) | (kp[None, :, 1] > qp[:, None, 1])
        out = dense(query[q_start : q_start + q_len], k_whole[k_start:k_end], v_whole[k_start:k_end], mask)
        outputs.append(out)
    return torch.cat(outputs, dim=0)


@lru_cache(maxsize=8)
def _calls(cu: tuple[int, ...], cp: int, rank: int, block_tokens: int):
    """One dense call per block: (local query start, query count, key start, key end, query (segment, position)
    [n, 2], key (segment, position) [m, 2]). A sequence longer than ``block_tokens`` makes two calls (one per chunk,
    keys up to the chunk's end); shorter consecutive ones share a call over the block's whole keys."""
    calls = []
    group: list[int] = []  # segment indices of the current block of short sequences

    def flush() -> None:
        if not group:
            return
        first, last = group[0], group[-1]
        k_start, k_end = cu[first], cu[last + 1]
        q_start = k_start // cp
        q_pos, k_pos = [], []
        for seg in group:
            s, e = cu[seg], cu[seg + 1]
            chunk = (e - s) // (2 * cp)
            for c in (rank, 2 * cp - 1 - rank):
                q_pos += [(seg, c * chunk + j) for j in range(chunk)]
            k_pos += [(seg, j) for j in range(e - s)]
        calls.append((q_start, (k_end - k_start) // cp, k_start, k_end, torch.tensor(q_pos), torch.tensor(k_pos)))
        group.clear()

    for seg, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end == start:
            continue
        if end - start > block_tokens:
            flush()
            chunk = (end - start) // (2 * cp)
            for i, c in enumerate((rank, 2 * cp - 1 - rank)):
                k_end = start + (c + 1) * chunk
                q_pos = torch.stack([torch.full((chunk,), seg), torch.arange(c * chunk, (c + 1) * chunk)], 1)
                k_pos = torch.stack([torch.full((k_end - start,), seg), torch.arange(k_end - start)], 1)
                calls.append((start // cp + i * chunk, chunk, start, k_end, q_pos, k_pos))
            continue
        if group and end - cu[group[0]] > block_tokens:
            flush()
        group.append(seg)
    flush()
    return tuple(calls)
