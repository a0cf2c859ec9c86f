"""The export's path for routed experts laid out apart from TP (EP > 1, or ETP != TP): `bridge/export.py` hands
each MoE layer's experts here instead of gathering them over TP.

Every EP rank holds the same number of local experts (``experts / ep``) with the same shapes, so one flat
all-gather of local expert ``j``'s weight over the stage's expert group (ETP x EP, megatron-core's
``expert_tensor_and_model_parallel_group``) gives every member the ETP shards of the experts ``j``, ``j + E/ep``, ...
at once: one gather per (layer, local expert, fc1/fc2), ``ep`` experts' bytes each, so the stream stays in bounded
buckets. Every rank of the stage is in one such group, and each group holds every EP and ETP rank, so every TP rank
then has every expert. Pipeline stages that do not own the layer receive the HF tensors by broadcast, as for the
other parameters. A collective over the stage's expert group (and, at PP > 1, the pipeline group): every actor rank
iterates the export, as the trainer and the engine ranks' sender do.

The plan (`ExpertLayout`, built once with the export plan): which group rank is which (EP rank, ETP rank), and for
each expert entry the name of this rank's own parameter that stands in for it (the local expert of the same index),
which also gives the owning stage, shape and dtype of the global expert.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.layout import shard_to_hf
from megatron_rlvr.bridge.mapping import ParamMapping, hf_shapes
from megatron_rlvr.models.dims import ModelDims

_EXPERTS = ".mlp.experts.local_experts."


@dataclass(frozen=True)
class ExpertLayout:
    ep: int
    ep_rank: int
    etp: int
    members: tuple[tuple[int, int], ...]  # (EP rank, ETP rank) of each rank of the expert group, by group rank


def expert_layout() -> ExpertLayout:
    """This rank's expert layout (a collective over the expert group: one object all-gather)."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_and_model_parallel_group()
    me = (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    members: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, me, group=group)
    return ExpertLayout(
        ps.get_expert_model_parallel_world_size(), me[0], ps.get_expert_tensor_parallel_world_size(), tuple(members)
    )


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """(prefix up to ``local_experts.``, global expert index, the rest) of an expert parameter's name, else None."""
    head, sep, tail = name.partition(_EXPERTS)
    if not sep:
        return None
    index, _, rest = tail.partition(".")
    return head + sep, int(index), rest


def stand_in_name(name: str, dims: ModelDims, layout: ExpertLayout) -> str:
    """The name of this rank's parameter with the same local index as global expert ``name`` (itself if held here)."""
    prefix, e, rest = split_expert_name(name)
    per_rank = dims.experts // layout.ep
    return f"{prefix}{layout.ep_rank * per_rank + e % per_rank}.{rest}"


@dataclass
class ExpertItem:
    """One gather: local expert ``local`` of one layer, fc1 or fc2 (``stand_in``: this rank's parameter for it);
    ``entries[ep_rank]`` is the plan entry of the global expert that EP rank contributes."""

    stand_in: str
    owner_stage: int
    entries: list[Any]  # export._PlanEntry, by EP rank


def expert_items(entries: list[Any], dims: ModelDims, layout: ExpertLayout) -> Iterator[Any]:
    """``entries`` (plan entries, HF order) with each MoE layer's expert entries replaced by its `ExpertItem`s, in
    the same order on every rank."""
    per_rank = dims.experts // layout.ep
    by_name = {pe.mapping.megatron: pe for pe in entries}
    done: set[str] = set()
    for pe in entries:
        parts = split_expert_name(pe.mapping.megatron) if pe.mapping.expert else None
        if parts is None:
            yield pe
            continue
        prefix = parts[0]
        if prefix in done:
            continue
        done.add(prefix)
        for local in range(per_rank):
            for rest in ("linear_fc1.weight", "linear_fc2.weight"):
                group = [by_name[f"{prefix}{r * per_rank + local}.{rest}"] for r in range(layout.ep)]
                stand_in = f"{prefix}{layout.ep_rank * per_rank + local}.{rest}"
                yield ExpertItem(stand_in, group[0].owner_stage, group)


def with_expert_items(entries: list[Any], dims: ModelDims, layout: ExpertLayout | None, rounds) -> Iterator[Any]:
    """The export's work in order: ``rounds(run)`` over each run of other entries, and the `ExpertItem`s between."""
    if layout is None:
        yield from rounds(entries)
        return
    run: list[Any] = []
    for item in expert_items(entries, dims, layout):
        if isinstance(item, ExpertItem):
            yield from rounds(run)
            run = []
            yield item
        else:
            run.append(item)
    yield from rounds(run)


def _views(m: ParamMapping, dims: ModelDims, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """One expert's HF tensors as views of one fresh buffer, back to back ([gate; up] for fc1)."""
    shapes = hf_shapes(m, dims)
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype)
    out, offset = [], 0
    for name, shape in zip(m.hf, shapes):
        out.append((name, flat[offset : offset + math.prod(shape)].view(tuple(shape))))
        offset += math.prod(shape)
    return out


def expert_tensors(
    item: ExpertItem,
    by_name: dict[str, torch.Tensor],
    dims: ModelDims,
    layout: ExpertLayout,
    pp_rank: int,
    pp_ranks: list[int],
    build: bool,
    dtype: torch.dtype | None,
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of ``item``'s experts (EP rank order); empty where ``build`` is False (a rank that neither
    receives nor broadcasts). Collective over the owner stage's expert group, then over the pipeline group."""
    from megatron.core import parallel_state as ps

    pp = len(pp_ranks)
    out: list[tuple[str, torch.Tensor]] = []
    first = item.entries[0]
    out_dtype = dtype or first.dtype
    if pp_rank == item.owner_stage:
        local = by_name[item.stand_in].detach().contiguous()
        size = len(layout.members)
        if size > 1:
            flat = torch.empty(size * local.numel(), dtype=local.dtype)
            dist.all_gather_into_tensor(flat, local.view(-1), group=ps.get_expert_tensor_and_model_parallel_group())
            shards = list(flat.view(size, *local.shape))
        else:
            shards = [local]
        if not (build or pp > 1):
            return []
        for ep_rank, pe in enumerate(item.entries):
            tensors = _views(pe.mapping, dims, out_dtype)
            views = dict(tensors)
            for (member_ep, etp_rank), shard in zip(layout.members, shards):
                if member_ep != ep_rank:
                    continue
                for name, piece, dim, start, stop in shard_to_hf(pe.mapping, shard, dims, etp_rank, layout.etp):
                    (views[name] if dim is None else views[name].narrow(dim, start, stop - start)).copy_(piece)
            out += tensors
        for _, t in out if pp > 1 else ():
            dist.broadcast(t, src=pp_ranks[item.owner_stage], group=ps.get_pipeline_model_parallel_group())
        return out
    for pe in item.entries:
        tensors = _views(pe.mapping, dims, out_dtype)
        for _, t in tensors:
            dist.broadcast(t, src=pp_ranks[item.owner_stage], group=ps.get_pipeline_model_parallel_group())
        out += tensors
    return out if build else []
