"""The export's plan of one model at one parallel layout, and the HF buffer of one parameter (`bridge/export.py`).

The plan (`ExportPlan`): for every Megatron parameter, the pipeline stage that owns it, its dtype and the shape of
its shard there, agreed with one object all-gather over the pipeline group. `plan_for` builds it once per model and
caches it on the model's first chunk; every later call re-checks this rank's parameters against it (one all-reduce
over the model-parallel group), so a missing or re-shaped tensor raises on every rank before anything is exported.
The plan also carries what the export's transports keep from call to call (the TP group's shared-memory exchanges,
the rounds done, the lending slot last written): state that lives exactly as long as the plan.

The HF buffer: the HF tensors of one parameter lie back to back in one flat buffer, in HF order ([q; k; v],
[gate; up]), so an engine with packed layers can take them without another copy. `hf_views` cuts a buffer into those
tensors, `write_pieces` writes one TP rank's shard into its places, and `assemble` fills a fresh buffer from every
rank's shard. `packed` cuts a stream into consecutive runs of bounded bytes: the export's rounds (`rounds`) and
buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.expert_export import ExpertLayout, expert_layout, stand_in_name
from megatron_rlvr.bridge.layout import shard_to_hf
from megatron_rlvr.bridge.local_params import BridgeError, as_chunks, experts_laid_out_apart, local_entries
from megatron_rlvr.bridge.mapping import ParamMapping, hf_shapes
from megatron_rlvr.bridge.shm_exchange import ShmExchange, aligned
from megatron_rlvr.models.dims import ModelDims

SHM_SLOT_BYTES = 64 << 20  # per-rank bytes of one exchange round (at least the largest shard); two slots alternate
_CACHE_ATTRIBUTE = "_megatron_rlvr_export_plan"  # where the plan is cached: on the model's first chunk

Item = TypeVar("Item")
HFTensors = list[tuple[str, torch.Tensor]]  # (HF name, tensor) pairs


@dataclass
class PlanEntry:
    """One Megatron parameter of the model: its mapping to HF, and where and how it is held."""

    mapping: ParamMapping
    owner_stage: int  # pipeline rank holding it
    dtype: torch.dtype
    local_shape: tuple[int, ...]  # the Megatron shard's shape on the owner stage


@dataclass
class ExportPlan:
    """Who holds what, for one model at one layout, and the export's state that lives as long as the plan."""

    dims: ModelDims
    tp: int
    tp_rank: int
    pp_rank: int
    pp_ranks: list[int]  # global ranks of this rank's pipeline group, by stage
    entries: list[PlanEntry]
    experts: ExpertLayout | None = None  # experts laid out apart from TP: exported by bridge/expert_export.py
    exchange: ShmExchange | None = None
    exchange_tried: bool = False
    rounds_done: int = 0  # exchange rounds so far: picks the slot, continuing across calls
    lend_exchange: ShmExchange | None = None  # lending: TP rank 0's segment of it holds each call's HF tensors
    lend_slot: int = 1  # the slot the last lending call wrote
    lend_whole: bool = False  # whole-call slots (host parameters), else one round per slot (bridge/export_lending.py)


class ParallelGroups(NamedTuple):
    """This rank's process groups and places in megatron-core's parallel state, as the export reads them."""

    tp_group: Any
    pp_group: Any
    tp_rank: int
    tp: int
    pp_rank: int
    mp_group: Any  # the model-parallel group: where a problem found on one rank is raised on every rank


def parallel_groups() -> ParallelGroups:
    from megatron.core import parallel_state as ps

    return ParallelGroups(
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_model_parallel_group(),
    )


def _local_name(m: ParamMapping, dims: ModelDims, experts: ExpertLayout | None) -> str:
    """The name of this rank's parameter that stands for ``m`` in the plan (an expert's local twin when apart)."""
    return stand_in_name(m.megatron, dims, experts) if experts is not None and m.expert else m.megatron


def plan_for(model_chunks, hf: Mapping[str, Any]) -> tuple[ExportPlan, dict[str, torch.Tensor], bool]:
    """(plan, this rank's parameters by global Megatron name, whether the plan was built by this call): validates on
    every call, builds the plan once per model. A collective over the model-parallel group."""
    groups = parallel_groups()
    dims = ModelDims.from_hf(hf)
    entries, problems = local_entries(model_chunks, dims, groups.tp)
    params = {e.mapping.megatron: e.param for e in entries if e.param is not None}
    cache_owner = as_chunks(model_chunks)[0]
    cached: ExportPlan | None = getattr(cache_owner, _CACHE_ATTRIBUTE, None)
    if cached is not None and cached.dims == dims:
        for pe in cached.entries:
            p = params.get(_local_name(pe.mapping, dims, cached.experts))
            if pe.owner_stage == groups.pp_rank and (p is None or tuple(p.shape) != pe.local_shape):
                problems.append(f"{pe.mapping.megatron}: missing or re-shaped since the export plan was built")
        raise_everywhere(problems, groups.mp_group)
        return cached, params, False
    # Experts laid out apart from TP (EP > 1 or ETP != TP) go through bridge/expert_export.py; each global expert
    # is then planned from this rank's parameter of the same local index.
    experts = expert_layout() if dims.experts and experts_laid_out_apart(groups.tp) else None
    # Which stage owns which parameter: one object all-gather over the pipeline group, once.
    mine = {e.mapping.megatron: (tuple(e.param.shape), e.param.dtype) for e in entries if e.param is not None}
    stages: list[Any] = [None] * dist.get_world_size(groups.pp_group)
    dist.all_gather_object(stages, mine, group=groups.pp_group)
    plan_entries = []
    for e in entries:
        name = _local_name(e.mapping, dims, experts)
        owners = [s for s, held in enumerate(stages) if name in held]
        if not owners:
            if name == "output_layer.weight" and dims.tied:
                continue  # tied at PP=1: lm_head is sent from the embedding
            problems.append(f"{name}: missing on every pipeline stage")
            continue
        owner = owners[-1] if name == "output_layer.weight" else owners[0]
        shape, dtype = stages[owner][name]
        plan_entries.append(PlanEntry(e.mapping, owner, dtype, shape))
    raise_everywhere(problems, groups.mp_group)
    pp_ranks = dist.get_process_group_ranks(groups.pp_group)
    plan = ExportPlan(dims, groups.tp, groups.tp_rank, groups.pp_rank, pp_ranks, plan_entries, experts)
    setattr(cache_owner, _CACHE_ATTRIBUTE, plan)
    return plan, params, True


def raise_everywhere(problems: list[str], group) -> None:
    """One all-reduce decides whether any rank found a problem; if so all ranks raise with everyone's messages."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if flag.item():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, problems, group=group)
        messages = sorted({p for rank_problems in gathered for p in rank_problems})
        raise BridgeError("weight export refused before sending anything: " + "; ".join(messages))


# ---------------------------------------------------------------------------------------------------------------
# The HF buffer of one parameter


def hf_numel(pe: PlanEntry, plan: ExportPlan) -> int:
    return sum(math.prod(s) for s in hf_shapes(pe.mapping, plan.dims))


def hf_views(pe: PlanEntry, plan: ExportPlan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``pe``'s HF tensors as views of ``flat``, back to back in HF order."""
    outs, offset = {}, 0
    for name, shape in zip(pe.mapping.hf, hf_shapes(pe.mapping, plan.dims)):
        outs[name] = flat[offset : offset + math.prod(shape)].view(tuple(shape))
        offset += math.prod(shape)
    return outs


def write_pieces(
    pe: PlanEntry, outs: dict[str, torch.Tensor], shard: torch.Tensor, tp_rank: int, plan: ExportPlan
) -> None:
    """Copy the HF pieces of TP rank ``tp_rank``'s ``shard`` into their places in ``outs``."""
    for name, piece, dim, start, stop in shard_to_hf(pe.mapping, shard, plan.dims, tp_rank, plan.tp):
        if dim is not None and stop <= start:
            continue  # a vocabulary shard of padding rows only (vocab < its start): nothing of the HF tensor
        (outs[name] if dim is None else outs[name].narrow(dim, start, stop - start)).copy_(piece)


def fresh_hf_tensors(pe: PlanEntry, plan: ExportPlan, dtype: torch.dtype | None) -> HFTensors:
    """``pe``'s HF tensors as views of one new buffer (not yet written)."""
    flat = torch.empty(hf_numel(pe, plan), dtype=dtype or pe.dtype)
    return list(hf_views(pe, plan, flat).items())


def assemble(
    pe: PlanEntry, shards: list[tuple[int, torch.Tensor]], plan: ExportPlan, dtype: torch.dtype | None
) -> HFTensors:
    """The HF tensors of one Megatron parameter from ``(tp_rank, shard)`` pairs, written once into one fresh buffer."""
    outs = dict(fresh_hf_tensors(pe, plan, dtype))
    for tp_rank, shard in shards:
        write_pieces(pe, outs, shard, tp_rank, plan)
    return list(outs.items())


def with_lm_head(
    pe: PlanEntry, tensors: HFTensors, dims: ModelDims, include_lm_head: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, then, for the embedding of a tied model, ``lm_head.weight`` too: the tied output layer is sent as
    the embedding (the master copy, whatever the PP layout)."""
    yield from tensors
    if pe.mapping.megatron == "embedding.word_embeddings.weight" and dims.tied and include_lm_head:
        yield "lm_head.weight", tensors[0][1]


# ---------------------------------------------------------------------------------------------------------------
# Bytes, rounds and buckets


def round_slot_bytes(plan: ExportPlan) -> int:
    """Per-rank bytes of one exchange round: SHM_SLOT_BYTES, or the largest shard if that is larger."""
    largest = max((aligned(math.prod(pe.local_shape) * pe.dtype.itemsize) for pe in plan.entries), default=0)
    return max(SHM_SLOT_BYTES, largest)


def shard_bytes(pe: PlanEntry, plan: ExportPlan) -> int:
    """Bytes of ``pe``'s TP shard in an exchange slot (0: replicated, not exchanged)."""
    sharded = pe.mapping.tp_dim is not None and plan.tp > 1
    return aligned(math.prod(pe.local_shape) * pe.dtype.itemsize) if sharded else 0


def hf_bytes(pe: PlanEntry, plan: ExportPlan, dtype: torch.dtype | None) -> int:
    """Bytes of ``pe``'s HF tensors (one buffer) in a lending slot."""
    return aligned(hf_numel(pe, plan) * (dtype or pe.dtype).itemsize)


def rounds(
    entries: Iterable[PlanEntry],
    plan: ExportPlan,
    slot_bytes: int,
    size_of: Callable[[PlanEntry, ExportPlan], int] = shard_bytes,
) -> Iterator[list[PlanEntry]]:
    """Consecutive entries of one owner stage whose ``size_of`` bytes fit one slot together."""

    def same_stage(first: PlanEntry, entry: PlanEntry) -> bool:
        return first.owner_stage == entry.owner_stage

    return packed(entries, lambda pe: size_of(pe, plan), slot_bytes, same_stage)


def packed(
    items: Iterable[Item],
    nbytes_of: Callable[[Item], int],
    limit: int,
    same_run: Callable[[Item, Item], bool] = lambda first, item: True,
) -> Iterator[list[Item]]:
    """Consecutive items in lists whose ``nbytes_of`` sum stays within ``limit`` (one larger item goes alone); a
    list also ends where ``same_run(its first item, the next)`` is false."""
    batch: list[Item] = []
    size = 0
    for item in items:
        nbytes = nbytes_of(item)
        if batch and (size + nbytes > limit or not same_run(batch[0], item)):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def bucketed(items: Iterable[Item], tensor_of: Callable[[Item], torch.Tensor], bucket_bytes: int) -> Iterator[list]:
    """``items`` in buckets of at most ``bucket_bytes`` of their tensors (one larger tensor goes alone)."""

    def nbytes(item: Item) -> int:
        t = tensor_of(item)
        return t.numel() * t.element_size()

    return packed(items, nbytes, bucket_bytes)
