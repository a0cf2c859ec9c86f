"""Streaming export of an actor's weights in HF names and layouts, at any (TP, PP), in buckets of bounded bytes.

``export_hf_weights``: for each parameter the owning pipeline stage gathers its TP shards, re-lays them out into HF
tensors, and broadcasts them over the pipeline group, so every receiving rank of the model-parallel group gets
every bucket. TP ranks on one host gather through shared memory (``_ShmExchange``: each rank writes its shards
once, receivers read them in place while re-laying out); otherwise one gloo all-gather per tensor. The HF tensors of
one parameter are written back to back into one buffer. ``export_local_shards``: the no-gather path for an engine
with the actor's TP on the same ranks; each rank re-lays out its own shard (pipeline stages still broadcast, since
an engine needs every layer).

Both are collectives over the model-parallel group: every rank must iterate them to the end. The plan (who owns
what, shapes, dtypes) is built once per model and cached; each call re-checks the local shapes with one
all-reduce, so a missing or mis-shaped tensor raises on every rank before anything is yielded. Each bucket holds
fresh tensors (never reused), so a consumer may keep them as long as it likes -- unless it asks for lent ones.

Lending (``export_hf_weights(..., lend=True)``, TP ranks on one host, PP=1): every rank writes the HF pieces of its own
shards straight into one shared output slot, laid out as the fresh buffers are, and receivers get views of that slot
instead of copies. The re-layout is then split across the TP ranks, and a rank that only serves (``receive=False``)
lays out the next round while the receivers consume this one; a bucket holds whole parameters. Where the parameters
are in host memory (a CPU actor), a slot holds one whole call's tensors and two slots alternate between calls, so a
lent tensor stays valid until this rank's next call but one; a consumer that keeps lent tensors past that (the CPU
engine computing with them: no copy at all) holds their slot (`bridge/lent_slots.py`); calls then write the other
slot, and lend nothing while every slot is held by some rank. Elsewhere (device parameters, whose host copy is only a
hand-over) a slot holds one round and two alternate between rounds, so /dev/shm holds two buckets, not two models: a
lent tensor is then valid only until this rank asks for the next bucket, and a consumer copies what it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.expert_export import (
    ExpertItem,
    ExpertLayout,
    expert_layout,
    expert_tensors,
    stand_in_name,
    with_expert_items,
)
from megatron_rlvr.bridge.layout import shard_to_hf
from megatron_rlvr.bridge.lent_slots import LENDING_SEGMENTS, held_slots
from megatron_rlvr.bridge.local_params import (
    BridgeError,
    as_chunks,
    experts_laid_out_apart,
    local_entries,
    raise_everywhere,
)
from megatron_rlvr.bridge.lora_merge import with_adapters
from megatron_rlvr.bridge.mapping import ParamMapping, hf_shapes
from megatron_rlvr.bridge.shm_exchange import ShmExchange as _ShmExchange
from megatron_rlvr.bridge.shm_exchange import aligned as _aligned
from megatron_rlvr.models.dims import ModelDims

DEFAULT_BUCKET_BYTES = 256 << 20
PLAN_BUILDS = 0  # how many export plans were built in this process (the tests check the cache with it)
SHM_EXCHANGE = True  # gather TP shards through shared memory when the TP group shares a host (tests turn it off)
LEND_WHOLE_CALLS = True  # lend host parameters in whole-call slots (tests turn it off: the device layout, on CPU)
SHM_SLOT_BYTES = 64 << 20  # per-rank bytes of one exchange round (at least the largest shard); two slots alternate


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
    experts: ExpertLayout | None = None  # experts laid out apart from TP: exported by bridge/expert_export.py
    exchange: _ShmExchange | None = None
    exchange_tried: bool = False
    rounds_done: int = 0  # exchange rounds so far: picks the slot, continuing across calls
    lend_exchange: _ShmExchange | None = None  # lending: TP rank 0's segment of it holds each call's HF tensors
    lend_slot: int = 1  # the slot the last lending call wrote
    lend_whole: bool = False  # whole-call slots (host parameters), else one round per slot (see the module docstring)


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


def _local_name(m: ParamMapping, dims: ModelDims, experts: ExpertLayout | None) -> str:
    """The name of this rank's parameter that stands for ``m`` in the plan (an expert's local twin when apart)."""
    return stand_in_name(m.megatron, dims, experts) if experts is not None and m.expert else m.megatron


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
            p = params.get(_local_name(pe.mapping, dims, cached.experts))
            if pe.owner_stage == pp_rank and (p is None or tuple(p.shape) != pe.local_shape):
                problems.append(f"{pe.mapping.megatron}: missing or re-shaped since the export plan was built")
        raise_everywhere(problems, mp_group)
        return cached, params
    # Experts laid out apart from TP (EP > 1 or ETP != TP) go through bridge/expert_export.py; each global expert
    # is then planned from this rank's parameter of the same local index.
    experts = expert_layout() if dims.experts and experts_laid_out_apart(tp) else None
    # Which stage owns which parameter: one object all-gather over the pipeline group, once.
    mine = {e.mapping.megatron: (tuple(e.param.shape), e.param.dtype) for e in entries if e.param is not None}
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
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
        plan_entries.append(_PlanEntry(e.mapping, owner, dtype, shape))
    raise_everywhere(problems, mp_group)
    plan = _Plan(dims, tp, tp_rank, pp_rank, dist.get_process_group_ranks(pp_group), plan_entries, experts)
    cache_owner._megatron_rlvr_export_plan = plan
    PLAN_BUILDS += 1
    return plan, params


def _assemble(
    pe: _PlanEntry, shards: list[tuple[int, torch.Tensor]], plan: _Plan, dtype
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one Megatron parameter from ``(tp_rank, shard)`` pairs, written once into one fresh buffer:
    the HF tensors of one parameter lie back to back ([q; k; v], [gate; up]), so an engine with packed layers can take
    them without another copy."""
    outs = _hf_views(pe, plan, torch.empty(_hf_numel(pe, plan), dtype=dtype or pe.dtype))
    for tp_rank, shard in shards:
        _write_pieces(pe, outs, shard, tp_rank, plan)
    return list(outs.items())


def _hf_numel(pe: _PlanEntry, plan: _Plan) -> int:
    return sum(math.prod(s) for s in hf_shapes(pe.mapping, plan.dims))


def _hf_views(pe: _PlanEntry, plan: _Plan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``pe``'s HF tensors as views of ``flat``, back to back in HF order."""
    outs, offset = {}, 0
    for name, shape in zip(pe.mapping.hf, hf_shapes(pe.mapping, plan.dims)):
        outs[name] = flat[offset : offset + math.prod(shape)].view(tuple(shape))
        offset += math.prod(shape)
    return outs


def _write_pieces(
    pe: _PlanEntry, outs: dict[str, torch.Tensor], shard: torch.Tensor, tp_rank: int, plan: _Plan
) -> None:
    """Copy the HF pieces of TP rank ``tp_rank``'s ``shard`` into their places in ``outs``."""
    for name, piece, dim, start, stop in shard_to_hf(pe.mapping, shard, plan.dims, tp_rank, plan.tp):
        if dim is not None and stop <= start:
            continue  # a vocabulary shard of padding rows only (vocab < its start): nothing of the HF tensor
        (outs[name] if dim is None else outs[name].narrow(dim, start, stop - start)).copy_(piece)


def _slot_bytes(plan: _Plan) -> int:
    largest = max((_aligned(math.prod(pe.local_shape) * pe.dtype.itemsize) for pe in plan.entries), default=0)
    return max(SHM_SLOT_BYTES, largest)


def _shard_bytes(pe: _PlanEntry, plan: _Plan) -> int:
    """Bytes of ``pe``'s TP shard in an exchange slot (0: replicated, not exchanged)."""
    sharded = pe.mapping.tp_dim is not None and plan.tp > 1
    return _aligned(math.prod(pe.local_shape) * pe.dtype.itemsize) if sharded else 0


def _hf_bytes(pe: _PlanEntry, plan: _Plan, dtype) -> int:
    """Bytes of ``pe``'s HF tensors (one buffer) in a lending slot."""
    return _aligned(_hf_numel(pe, plan) * (dtype or pe.dtype).itemsize)


def _rounds(
    entries: list[_PlanEntry], plan: _Plan, slot_bytes: int, size_of=_shard_bytes
) -> Iterator[list[_PlanEntry]]:
    """Consecutive entries of one owner stage whose ``size_of`` bytes fit one slot together."""
    return _packed(entries, lambda pe: size_of(pe, plan), slot_bytes, lambda a, b: a.owner_stage == b.owner_stage)


def _packed(items, nbytes_of, limit: int, same_run=lambda first, item: True) -> Iterator[list]:
    """Consecutive items in lists whose ``nbytes_of`` sum stays within ``limit`` (one larger item goes alone); a
    list also ends where ``same_run(its first item, the next)`` is false."""
    batch: list = []
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


def _gathered_round(
    batch: list[_PlanEntry],
    by_name: dict[str, torch.Tensor],
    plan: _Plan,
    tp_group,
    read: bool,
    others_read: bool,
    dtype,
) -> list[list[tuple[str, torch.Tensor]]]:
    """On the owner stage: the HF tensors of each entry of ``batch`` (empty lists where ``read`` is False)."""
    sharded = [pe for pe in batch if pe.mapping.tp_dim is not None and plan.tp > 1]
    per_rank: dict[str, list[torch.Tensor]] = {}
    if sharded and plan.exchange is not None:
        slot = plan.rounds_done % 2
        plan.rounds_done += 1
        shards = [by_name[pe.mapping.megatron].detach() for pe in sharded]
        views = plan.exchange.round(shards, slot, write=others_read, read=read)
        per_rank = {pe.mapping.megatron: v for pe, v in zip(sharded, views)}
    else:
        for pe in sharded:
            shard = by_name[pe.mapping.megatron].detach().contiguous()
            # One flat all-gather into a single buffer (gloo's list all-gather plus a cat measured ~5x slower).
            flat = torch.empty(plan.tp * shard.numel(), dtype=shard.dtype)
            dist.all_gather_into_tensor(flat, shard.view(-1), group=tp_group)
            per_rank[pe.mapping.megatron] = list(flat.view(plan.tp, *shard.shape))
    if not read:
        return [[] for _ in batch]
    out = []
    for pe in batch:
        views = per_rank.get(pe.mapping.megatron)
        # read once per call: a LoRA-merged weight is merged when read (lora_merge.py)
        own = [(plan.tp_rank, by_name[pe.mapping.megatron].detach())] if views is None else []
        shards = list(enumerate(views)) if views is not None else own
        out.append(_assemble(pe, shards, plan, dtype))
    return out


def _lent_round(
    batch: list[_PlanEntry],
    by_name: dict[str, torch.Tensor],
    plan: _Plan,
    write: bool,
    read: bool,
    dtype,
    offset: int,
) -> tuple[list[list[tuple[str, torch.Tensor]]], int]:
    """Lending: each rank writes the HF pieces of its own shards (TP rank 0 also the replicated tensors) into this
    call's shared slot from byte ``offset`` on, one barrier, then every receiver takes views of the slot (see the
    module docstring). The slot holds each entry's HF tensors back to back, as `_assemble`'s buffer does. Returns the
    tensors and the offset after them."""
    exchange = plan.lend_exchange
    segment = exchange.segments[0]
    out = []
    for pe in batch:
        nbytes = _hf_bytes(pe, plan, dtype)
        outs = _hf_views(pe, plan, segment[offset : offset + nbytes].view(dtype or pe.dtype))
        offset += nbytes
        if write and (pe.mapping.tp_dim is not None or plan.tp_rank == 0):
            _write_pieces(pe, outs, by_name[pe.mapping.megatron].detach(), plan.tp_rank, plan)
        out.append(list(outs.items()))
    dist.barrier(group=exchange.group)  # every rank has written this round; the next call writes the other slot
    return (out if read else [[] for _ in batch]), offset


def _lending(plan: _Plan, tp_group, receive: bool, lend: bool, dtype, pp: int) -> tuple[bool, bool]:
    """(others_read, lending) for this call, agreed by the TP group (a collective); sets ``plan.lend_slot`` when
    lending. Lending needs the shared-memory exchange, PP=1, one output dtype on every rank, at least one rank
    asking for it, and a slot no rank holds (the one not written last, if free)."""
    if plan.tp == 1 or pp > 1:
        return pp > 1, False
    wishes: list[Any] = [None] * plan.tp
    mine = (bool(receive), bool(lend), str(dtype), held_slots(plan.lend_exchange), plan.lend_whole)
    dist.all_gather_object(wishes, mine, group=tp_group)
    others_read = any(w[0] for i, w in enumerate(wishes) if i != plan.tp_rank)
    lending = plan.exchange is not None and any(w[0] and w[1] for w in wishes) and len({w[2] for w in wishes}) == 1
    if lending:
        whole = plan.lend_whole = all(w[4] for w in wishes)
        held = {i for w in wishes for i in w[3]}
        largest = max(_hf_bytes(pe, plan, dtype) for pe in plan.entries)
        need = (
            sum(_hf_bytes(pe, plan, dtype) for pe in plan.entries)
            if whole
            else max(plan.tp * _slot_bytes(plan), largest)
        )
        if plan.lend_exchange is None or plan.lend_exchange.slot_bytes < need:  # the same decision on every rank
            old = plan.lend_exchange
            if old is not None:
                LENDING_SEGMENTS.pop(old.segments[0].data_ptr(), None)
            plan.lend_exchange = _ShmExchange.open(tp_group, plan.tp_rank, need)
            held = set()  # holds are on the old exchange's memory, which this call no longer writes
            if plan.lend_exchange is not None and whole:
                LENDING_SEGMENTS[plan.lend_exchange.segments[0].data_ptr()] = plan.lend_exchange
        if not whole and plan.lend_exchange is not None:  # round slots: never adopted by a consumer
            LENDING_SEGMENTS.pop(plan.lend_exchange.segments[0].data_ptr(), None)
        free = [i for i in (1 - plan.lend_slot, plan.lend_slot) if i not in held] if whole else [0]
        lending = plan.lend_exchange is not None and bool(free)
        if lending:
            plan.lend_slot = free[0]
    return others_read, lending


def _received(pe: _PlanEntry, plan: _Plan, pp_group, dtype) -> list[tuple[str, torch.Tensor]]:
    """On a stage that does not own ``pe``: its HF tensors, broadcast by the owner stage (one buffer, as there)."""
    out = list(_hf_views(pe, plan, torch.empty(_hf_numel(pe, plan), dtype=dtype or pe.dtype)).items())
    for _, t in out:
        dist.broadcast(t, src=plan.pp_ranks[pe.owner_stage], group=pp_group)
    return out


def _bucketed(items: Iterator[Any], tensor_of, bucket_bytes: int) -> Iterator[list]:
    def nbytes(item) -> int:
        t = tensor_of(item)
        return t.numel() * t.element_size()

    return _packed(items, nbytes, bucket_bytes)


@torch.no_grad()
def export_hf_weights(
    model_chunks,
    hf: Mapping[str, Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    include_lm_head: bool = True,
    dtype: torch.dtype | None = None,
    receive: bool = True,
    lend: bool = False,
    lora_scale: float | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` in HF layout, vocab padding stripped, yielded on every rank of the
    model-parallel group that passes ``receive=True``. A bucket exceeds ``bucket_bytes`` only when it is one tensor
    larger than that. ``receive=False``: this rank only serves its shards and gets no bucket (a rank without an
    engine; the gather then skips the re-layout there). It is still a collective: iterate to the end.

    ``include_lm_head``: for tied embeddings, also send ``lm_head.weight`` (= the embedding; an engine keeps its own
    copy and would otherwise keep a stale output layer). Pass False to write an HF checkpoint, where a tied model
    has no lm_head. Untied models always send their own lm_head. ``dtype``: cast (e.g. for a bf16 engine).

    ``lend``: views of shared memory instead of fresh tensors, valid only until this rank asks for the next bucket
    (see the module docstring); each bucket then holds whole parameters, at most ``bucket_bytes`` unless one
    parameter is larger. Where lending is not possible (PP > 1, TP = 1, no shared memory) the tensors are fresh, which
    satisfies the same contract. Every rank of the TP group must pass the same ``dtype`` for lending to be used.

    ``lora_scale``: the model carries LoRA adapters (models/lora.py), scaled by ``lora_scale`` = alpha / r; each
    adapted weight is exported merged, ``W + lora_scale * B A``, merged shard by shard as it is read (lora_merge.py).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan, by_name = _plan(model_chunks, hf)
    plan.lend_whole = LEND_WHOLE_CALLS and all(p.device.type == "cpu" for p in by_name.values())  # agreed below
    by_name = with_adapters(model_chunks, by_name, lora_scale)
    tp_group, pp_group = _groups()[:2]
    if plan.tp > 1 and not plan.exchange_tried:
        plan.exchange = _ShmExchange.open(tp_group, plan.tp_rank, _slot_bytes(plan)) if SHM_EXCHANGE else None
        plan.exchange_tried = True
    pp = len(plan.pp_ranks)
    # others_read: every owner-stage rank builds what it broadcasts (PP > 1), else whether another TP rank receives
    # experts laid out apart come as fresh tensors (their gather is not lent): the whole call then lends nothing
    others_read, lending = _lending(plan, tp_group, receive, lend and plan.experts is None, dtype, pp)
    entries = [pe for pe in plan.entries if not (pe.mapping.megatron == "output_layer.weight" and plan.dims.tied)]

    def with_lm_head(pe: _PlanEntry, tensors: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from tensors
        # The tied output layer is sent as the embedding (the master copy, whatever the PP layout).
        if pe.mapping.megatron == "embedding.word_embeddings.weight" and plan.dims.tied and include_lm_head:
            yield "lm_head.weight", tensors[0][1]

    def lent_buckets():
        # One bucket per round: laid out one after another in this call's slot, or each round in the other slot
        size_of = lambda pe, plan: _hf_bytes(pe, plan, dtype)  # noqa: E731
        offset = plan.lend_slot * plan.lend_exchange.slot_bytes
        for batch in _rounds(entries, plan, min(bucket_bytes, plan.lend_exchange.slot_bytes), size_of):
            if not plan.lend_whole:
                offset = (plan.rounds_done % 2) * plan.lend_exchange.slot_bytes
                plan.rounds_done += 1
            built, offset = _lent_round(batch, by_name, plan, others_read or receive, receive, dtype, offset)
            if receive:
                bucket = [item for pe, tensors in zip(batch, built) for item in with_lm_head(pe, tensors)]
                yield bucket if lend else [(n, t.clone()) for n, t in bucket]

    if lending:
        yield from lent_buckets()
        return

    def stream():
        for batch in with_expert_items(
            entries, plan.dims, plan.experts, lambda run: _rounds(run, plan, _slot_bytes(plan))
        ):
            if isinstance(batch, ExpertItem):
                yield from expert_tensors(
                    batch, by_name, plan.dims, plan.experts, plan.pp_rank, plan.pp_ranks, receive, dtype
                )
                continue
            if plan.pp_rank == batch[0].owner_stage:
                # The owner stage builds what it broadcasts, whether or not it receives.
                built = _gathered_round(batch, by_name, plan, tp_group, receive or pp > 1, others_read, dtype)
                for pe, tensors in zip(batch, built):
                    for _, t in tensors if pp > 1 else ():
                        dist.broadcast(t, src=plan.pp_ranks[pe.owner_stage], group=pp_group)
            else:
                built = [_received(pe, plan, pp_group, dtype) for pe in batch]
            if not receive:
                continue
            for pe, tensors in zip(batch, built):
                yield from with_lm_head(pe, tensors)

    yield from _bucketed(stream(), lambda item: item[1], bucket_bytes)


@torch.no_grad()
def export_local_shards(
    model_chunks,
    hf: Mapping[str, Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    include_lm_head: bool = True,
    dtype: torch.dtype | None = None,
    lora_scale: float | None = None,
) -> Iterator[list[HFShard]]:
    """Buckets of :class:`HFShard`: this rank's own TP shard of every HF tensor, re-laid out locally with no
    all-gather, for an engine whose TP equals the actor's and whose rank r holds Megatron's shard r.

    Pipeline stages broadcast their shards to the other stages of the same TP rank. Vocab padding is stripped
    (the last ranks' vocab slices may be shorter or empty); ``start``/``stop`` say which rows each shard holds.
    ``lora_scale``: as for `export_hf_weights`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan, by_name = _plan(model_chunks, hf)
    by_name = with_adapters(model_chunks, by_name, lora_scale)
    if plan.experts is not None:  # every rank holds the same names here; an engine at the actor's TP holds all experts
        raise BridgeError(
            "export_local_shards: experts laid out apart from TP (EP > 1 or ETP != TP); use export_hf_weights"
        )
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
