"""Results of the actor's passes brought to every rank: per-sequence rows from the last pipeline stage and every
data-parallel rank into the whole mini-batch, and loss metrics summed or averaged over data parallelism.

Context-parallel ranks of one DP rank hold identical rows and metrics (every CP rank computes the whole
micro-batch's statistics and loss, actor/context_parallel.py), so nothing here reduces over CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlvr.actor.packing import Plan
from megatron_rlvr.runtime import distributed


def to_every_rank(rows: list[torch.Tensor], plan: Plan, size: int, width: int) -> torch.Tensor:
    """Per-sequence rows [n, width] of this rank's micro-batches, in plan order (on the last pipeline stage;
    empty elsewhere) -> the whole mini-batch [size, width] in its own order, on every rank, on the CPU."""
    from megatron.core import parallel_state as ps

    device = distributed.device()
    local = sum(len(m) for m in plan[ps.get_data_parallel_rank()])
    if rows:
        values = torch.cat(rows).to(device=device, dtype=torch.float32)
    else:  # not the last pipeline stage: filled by the broadcast below
        values = torch.empty(local, width, dtype=torch.float32, device=device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        dist.broadcast(values, src=last, group=group)
    if ps.get_data_parallel_world_size() > 1:  # every rank holds as many sequences (balanced_split)
        parts = [torch.empty_like(values) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(parts, values, group=ps.get_data_parallel_group())
        values = torch.cat(parts)
    order = torch.tensor([i for share in plan for m in share for i in m])
    out = torch.empty(size, width, dtype=torch.float32)
    out[order] = values.cpu()
    return out


def across_data_parallel(metrics: dict[str, float], summed: tuple[str, ...]) -> dict[str, float]:
    """Each DP rank saw a slice of the mini-batch: sum the globally normalized loss, average the rest."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values, group=ps.get_data_parallel_group())
    return {k: float(v) if k in summed else float(v) / dp for k, v in zip(keys, values)}


def from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """Loss metrics exist on the last pipeline stage; give every rank the same dict."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics if ps.is_pipeline_last_stage() else None]
    src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size() - 1)
    dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]
