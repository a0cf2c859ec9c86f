"""Streaming export of an actor's weights in HF names and layouts, at any (TP, PP), in buckets of bounded bytes.

``export_hf_weights``: for each parameter the owning pipeline stage all-gathers its TP shards, re-lays them out
into HF tensors, and broadcasts them over the pipeline group, so every rank of the model-parallel group receives
every bucket. ``export_local_shards``: the no-gather path for an engine with the actor's TP on the same ranks; each
rank re-lays out its own shard (pipeline stages still broadcast, since an engine needs every layer).

Both are collectives over the model-parallel group: every rank must iterate them to the end. The plan (who owns
what, shapes, dtypes) is built once per model and cached; each call re-checks the local shapes with one
all-reduce, so a missing or mis-shaped tensor raises on every rank before anything is yielded. Each bucket holds
fresh tensors (never reused), so a consumer may keep them as long as it likes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.layout import shard_to_hf, to_hf
from megatron_rlvr.bridge.local_params import BridgeError, as_chunks, local_entries
from megatron_rlvr.bridge.mapping import ModelDims, ParamMapping, hf_shapes

DEFAULT_BUCKET_BYTES = 256 << 20
PLAN_BUILDS = 0  # how many export plans were built in this process (the tests check the cache with it)


@dataclass(frozen=True)
class HFShard:
    """One rank's slice of an HF tensor: ``tensor == full[start:stop]`` along ``dim`` (dim None: the whole
    tensor, replicated on every TP rank). ``full_shape`` is the HF tensor's shape."""

    name: str
    tensor: torch.Tensor
    dim: int | None
    start: int
    stop: int
    full_shape: tuple[int, ...]


@dataclass
class _PlanEntry:
    mapping: ParamMapping
    owner_stage: int  # pipeline rank holding it
    dtype: torch.dtype
    local_shape: tuple[int, ...]  # the Megatron shard's shape on the owner stage


@dataclass
class _Plan:
    dims: ModelDims
    tp: int
    tp_rank: int
    pp_rank: int
    pp_ranks: list[int]  # global ranks of this rank's pipeline group, by stage
    entries: list[_PlanEntry]


def _groups():
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_model_parallel_group(),
    )


def _raise_everywhere(problems: list[str], group) -> None:
    """One all-reduce decides whether any rank found a problem; if so all ranks raise with everyone's messages."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if flag.item():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, problems, group=group)
        messages = sorted({p for rank_problems in gathered for p in rank_problems})
        raise BridgeError("weight export refused before sending anything: " + "; ".join(messages))


def _plan(model_chunks, hf: Mapping[str, Any]) -> tuple[_Plan, dict[str, torch.Tensor]]:
    """(plan, this rank's parameters by global Megatron name); validates on every call, builds the plan once."""
    global PLAN_BUILDS
    tp_group, pp_group, tp_rank, tp, pp_rank, mp_group = _groups()
    dims = ModelDims.from_hf(hf)
    entries, problems = local_entries(model_chunks, dims, tp)
    params = {e.mapping.megatron: e.param for e in entries if e.param is not None}
    cache_owner = as_chunks(model_chunks)[0]
    cached: _Plan | None = getattr(cache_owner, "_megatron_rlvr_export_plan", None)
    if cached is not None and cached.dims == dims:
        for pe in cached.entries:
            p = params.get(pe.mapping.megatron)
            if pe.owner_stage == pp_rank and (p is None or tuple(p.shape) != pe.local_shape):
                problems.append(f"{pe.mapping.megatron}: missing or re-shaped since the export plan was built")
        _raise_everywhere(problems, mp_group)
        return cached, params
    # Which stage owns which parameter: one object all-gather over the pipeline group, once.
    mine = {e.mapping.megatron: (tuple(e.param.shape), e.param.dtype) for e in entries if e.param is not None}
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    plan_entries = []
    for e in entries:
        name = e.mapping.megatron
        owners = [s for s, held in enumerate(stages) if name in held]
        if not owners:
            if name == "output_layer.weight" and dims.tied:
                continue  # tied at PP=1: lm_head is sent from the embedding
            problems.append(f"{name}: missing on every pipeline stage")
            continue
        owner = owners[-1] if name == "output_layer.weight" else owners[0]
        shape, dtype = stages[owner][name]
        plan_entries.append(_PlanEntry(e.mapping, owner, dtype, shape))
    _raise_everywhere(problems, mp_group)
    plan = _Plan(dims, tp, tp_rank, pp_rank, dist.get_process_group_ranks(pp_group), plan_entries)
    cache_owner._megatron_rlvr_export_plan = plan
    PLAN_BUILDS += 1
    return plan, params


def _gathered_hf(pe: _PlanEntry, param: torch.Tensor | None, plan: _Plan, tp_group) -> list[tuple[str, torch.Tensor]]:
    """On the owner stage: all-gather TP shards and re-lay out into HF tensors."""
    shard = param.detach()
    if pe.mapping.tp_dim is None or plan.tp == 1:
        full = shard.clone()
    else:
        # One flat all-gather into a single buffer (gloo's list all-gather plus a cat measured ~5x slower).
        flat = torch.empty(plan.tp * shard.numel(), dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(flat, shard.contiguous().view(-1), group=tp_group)
        stacked = flat.view(plan.tp, *shard.shape)
        full = stacked.movedim(0, pe.mapping.tp_dim).reshape(
            *shard.shape[: pe.mapping.tp_dim], -1, *shard.shape[pe.mapping.tp_dim + 1 :]
        )
    return [(n, t.contiguous()) for n, t in to_hf(pe.mapping, full, plan.dims, plan.tp)]


def _broadcast_from_owner(
    pe: _PlanEntry, plan: _Plan, pp_group, produce, shapes: list[tuple[int, ...]], names: list[str]
) -> list[tuple[str, torch.Tensor]]:
    if len(plan.pp_ranks) == 1:
        return produce()
    if plan.pp_rank == pe.owner_stage:
        tensors = produce()
    else:
        tensors = [(n, torch.empty(s, dtype=pe.dtype)) for n, s in zip(names, shapes)]
    for _, t in tensors:
        dist.broadcast(t, src=plan.pp_ranks[pe.owner_stage], group=pp_group)
    return tensors


def _bucketed(items: Iterator[Any], tensor_of, bucket_bytes: int) -> Iterator[list]:
    bucket, size = [], 0
    for item in items:
        t = tensor_of(item)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def export_hf_weights(
    model_chunks,
    hf: Mapping[str, Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    include_lm_head: bool = True,
    dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` in HF layout, vocab padding stripped, yielded on every rank of the
    model-parallel group. A bucket exceeds ``bucket_bytes`` only when it is one tensor larger than that.

    ``include_lm_head``: for tied embeddings, also send ``lm_head.weight`` (= the embedding; an engine keeps its own
    copy and would otherwise keep a stale output layer). Pass False to write an HF checkpoint, where a tied model
    has no lm_head. Untied models always send their own lm_head. ``dtype``: cast (e.g. for a bf16 engine).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan, by_name = _plan(model_chunks, hf)
    tp_group, pp_group = _groups()[:2]

    def stream():
        for pe in plan.entries:
            m = pe.mapping
            if m.megatron == "output_layer.weight" and plan.dims.tied:
                continue  # sent as a copy of the embedding below (the master copy, whatever the PP layout)
            names, shapes = list(m.hf), [tuple(s) for s in hf_shapes(m, plan.dims)]
            tensors = _broadcast_from_owner(
                pe, plan, pp_group, lambda: _gathered_hf(pe, by_name[m.megatron], plan, tp_group), shapes, names
            )
            for name, t in tensors:
                yield name, (t if dtype is None else t.to(dtype))
            if m.megatron == "embedding.word_embeddings.weight" and plan.dims.tied and include_lm_head:
                yield "lm_head.weight", (tensors[0][1] if dtype is None else tensors[0][1].to(dtype))

    yield from _bucketed(stream(), lambda item: item[1], bucket_bytes)


@torch.no_grad()
def export_local_shards(
    model_chunks,
    hf: Mapping[str, Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    include_lm_head: bool = True,
    dtype: torch.dtype | None = None,
) -> Iterator[list[HFShard]]:
    """Buckets of :class:`HFShard`: this rank's own TP shard of every HF tensor, re-laid out locally with no
    all-gather, for an engine whose TP equals the actor's and whose rank r holds Megatron's shard r.

    Pipeline stages broadcast their shards to the other stages of the same TP rank. Vocab padding is stripped
    (the last ranks' vocab slices may be shorter or empty); ``start``/``stop`` say which rows each shard holds.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan, by_name = _plan(model_chunks, hf)
    pp_group = _groups()[1]
    dims = plan.dims

    def cast(s: HFShard) -> HFShard:
        return s if dtype is None else HFShard(s.name, s.tensor.to(dtype), s.dim, s.start, s.stop, s.full_shape)

    def stream():
        for pe in plan.entries:
            m = pe.mapping
            if m.megatron == "output_layer.weight" and dims.tied:
                continue  # sent as a copy of the embedding's shard below
            if len(plan.pp_ranks) == 1 or plan.pp_rank == pe.owner_stage:
                shard = by_name[m.megatron].detach().clone()
            else:
                shard = torch.empty(pe.local_shape, dtype=pe.dtype)
            if len(plan.pp_ranks) > 1:
                dist.broadcast(shard, src=plan.pp_ranks[pe.owner_stage], group=pp_group)
            full_shapes = [tuple(s) for s in hf_shapes(m, dims)]
            pieces = shard_to_hf(m, shard, dims, plan.tp_rank, plan.tp)
            out = [HFShard(n, t.contiguous(), d, a, b, fs) for (n, t, d, a, b), fs in zip(pieces, full_shapes)]
            yield from (cast(s) for s in out)
            if m.megatron == "embedding.word_embeddings.weight" and dims.tied and include_lm_head:
                e = out[0]
                yield cast(HFShard("lm_head.weight", e.tensor, e.dim, e.start, e.stop, e.full_shape))

    yield from _bucketed(stream(), lambda s: s.tensor, bucket_bytes)
