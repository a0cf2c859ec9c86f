"""Context parallelism on the actor's side (docs/context-parallel.md): per-token values of each CP rank's stream
gathered into the whole stream, and the ``PackedSeqParams`` of a CP-split stream.

Each CP rank runs the model and the fused statistics op on its own share of every sequence. ``gather_stream``
all-gathers the op's per-token outputs (small: [T_local] and [T_local, N] fields) over the CP group, so every CP rank
holds the statistics of whole sequences and computes the identical loss of the whole micro-batch on the padded view:
token-level and sequence-level terms (per-response aggregation, sequence-level rollout correction, PBA's per-sequence
KL coefficient) are then unchanged. Its backward keeps this rank's own slice of the (identical) gradient, so each CP
rank's parameter gradient is its share of the whole one; megatron's DDP sums them over the data-parallel group with
context parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlvr.actor.packing import PackedLayout, unpack


class _GatherKeepOwnGrad(torch.autograd.Function):
    """all-gather along dim 0 over ``group``; backward: this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(values) for _ in range(ctx.size)]
        dist.all_gather(parts, values.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size)[ctx.rank], None


def gather_stream(values: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """This CP rank's per-token values [T_local, ...] -> every rank's, rank after rank [cp * T_local, ...] (the
    order ``unpack`` reads under CP); the identity at cp = 1."""
    if layout.cp == 1:
        return values
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    if values.requires_grad:
        return _GatherKeepOwnGrad.apply(values, group)
    parts = [torch.empty_like(values) for _ in range(layout.cp)]
    dist.all_gather(parts, values.contiguous(), group=group)
    return torch.cat(parts)


def stream_to_view(values: torch.Tensor, layout: PackedLayout, shape: tuple[int, int]) -> torch.Tensor:
    """This rank's per-token values [T_local, ...] -> the whole micro-batch's [b, S - 1, ...] view (on every CP rank)."""
    return unpack(gather_stream(values, layout), layout, shape)


def packed_seq_params(layout: PackedLayout, device: torch.device):
    """megatron-core's THD parameters of a stream: ``cu_seqlens`` / ``max_seqlen`` of the whole (padded) stream, as
    its RoPE and TE's CP attention expect under CP (each CP rank holds 1 / cp of every segment)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = layout.cu_seqlens.to(device)
    padded = dict(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu) if layout.cp > 1 else {}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
        **padded,
    )


def padding_fraction(lengths: list[int], cp: int) -> float:
    """Share of the streams' tokens that CP's per-sequence padding (to a multiple of 2 * cp) adds, over a mini-batch."""
    from megatron_rlvr.actor.packing import cp_padded_length

    padded = sum(cp_padded_length(n, cp) for n in lengths)
    return (padded - sum(lengths)) / max(padded, 1)
