"""Streaming export of an actor's weights in HF names and layouts, at any (TP, PP), in buckets of bounded bytes.

``export_hf_weights``: for each parameter the owning pipeline stage gathers its TP shards, re-lays them out into HF
tensors, and broadcasts them over the pipeline group, so every receiving rank of the model-parallel group gets
every bucket. TP ranks on one host gather through shared memory (``ShmExchange``: each rank writes its shards
once, receivers read them in place while re-laying out); otherwise one gloo all-gather per tensor. The HF tensors of
one parameter are written back to back into one buffer. With ``lend=True`` (TP ranks on one host, PP=1) the buckets
are views of shared memory instead (bridge/export_lending.py). ``export_local_shards``: the no-gather path for an
engine with the actor's TP on the same ranks; each rank re-lays out its own shard (pipeline stages still broadcast,
since an engine needs every layer).

Both are collectives over the model-parallel group: every rank must iterate them to the end. The plan (who owns
what, shapes, dtypes; bridge/export_plan.py) is built once per model and cached; each call re-checks the local
shapes with one all-reduce, so a missing or mis-shaped tensor raises on every rank before anything is yielded. Each
bucket holds fresh tensors (never reused), so a consumer may keep them as long as it likes -- unless it asks for
lent ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.expert_export import ExpertItem, expert_tensors, with_expert_items
from megatron_rlvr.bridge.export_lending import agree_on_lending, lent_buckets
from megatron_rlvr.bridge.export_plan import (
    ExportPlan,
    HFTensors,
    PlanEntry,
    assemble,
    bucketed,
    fresh_hf_tensors,
    parallel_groups,
    plan_for,
    round_slot_bytes,
    rounds,
    with_lm_head,
)
from megatron_rlvr.bridge.layout import shard_to_hf
from megatron_rlvr.bridge.local_params import BridgeError
from megatron_rlvr.bridge.lora_merge import with_adapters
from megatron_rlvr.bridge.mapping import hf_shapes
from megatron_rlvr.bridge.shm_exchange import ShmExchange

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


def _plan(model_chunks, hf: Mapping[str, Any]) -> tuple[ExportPlan, dict[str, torch.Tensor]]:
    """(plan, this rank's parameters by global Megatron name), counting the plans built in PLAN_BUILDS."""
    global PLAN_BUILDS
    plan, params, built = plan_for(model_chunks, hf)
    PLAN_BUILDS += built
    return plan, params


def _gathered_round(
    batch: list[PlanEntry],
    by_name: dict[str, torch.Tensor],
    plan: ExportPlan,
    tp_group,
    read: bool,
    others_read: bool,
    dtype: torch.dtype | None,
) -> list[HFTensors]:
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
        out.append(assemble(pe, shards, plan, dtype))
    return out


def _received(pe: PlanEntry, plan: ExportPlan, pp_group, dtype: torch.dtype | None) -> HFTensors:
    """On a stage that does not own ``pe``: its HF tensors, broadcast by the owner stage (one buffer, as there)."""
    out = fresh_hf_tensors(pe, plan, dtype)
    for _, t in out:
        dist.broadcast(t, src=plan.pp_ranks[pe.owner_stage], group=pp_group)
    return out


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
    shm_exchange: bool = True,
    lend_whole_calls: bool = True,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` in HF layout, vocab padding stripped, yielded on every rank of the
    model-parallel group that passes ``receive=True``. A bucket exceeds ``bucket_bytes`` only when it is one tensor
    larger than that. ``receive=False``: this rank only serves its shards and gets no bucket (a rank without an
    engine; the gather then skips the re-layout there). It is still a collective: iterate to the end.

    ``include_lm_head``: for tied embeddings, also send ``lm_head.weight`` (= the embedding; an engine keeps its own
    copy and would otherwise keep a stale output layer). Pass False to write an HF checkpoint, where a tied model
    has no lm_head. Untied models always send their own lm_head. ``dtype``: cast (e.g. for a bf16 engine).

    ``lend``: views of shared memory instead of fresh tensors, valid only until this rank asks for the next bucket
    (bridge/export_lending.py); each bucket then holds whole parameters, at most ``bucket_bytes`` unless one
    parameter is larger. Where lending is not possible (PP > 1, TP = 1, no shared memory) the tensors are fresh, which
    satisfies the same contract. Every rank of the TP group must pass the same ``dtype`` for lending to be used.

    ``lora_scale``: the model carries LoRA adapters (models/lora.py), scaled by ``lora_scale`` = alpha / r; each
    adapted weight is exported merged, ``W + lora_scale * B A``, merged shard by shard as it is read (lora_merge.py).

    ``shm_exchange``: gather TP shards through shared memory when the TP group shares a host (False: through the
    TP group's collectives; the first export of these chunks decides). ``lend_whole_calls``: lend host parameters in
    slots that hold the whole call (False: the round-by-round slots device parameters use, also on CPU).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan, by_name = _plan(model_chunks, hf)
    plan.lend_whole = lend_whole_calls and all(p.device.type == "cpu" for p in by_name.values())  # agreed below
    by_name = with_adapters(model_chunks, by_name, lora_scale)
    groups = parallel_groups()
    tp_group, pp_group = groups.tp_group, groups.pp_group
    if plan.tp > 1 and not plan.exchange_tried:
        plan.exchange = ShmExchange.open(tp_group, plan.tp_rank, round_slot_bytes(plan)) if shm_exchange else None
        plan.exchange_tried = True
    pp = len(plan.pp_ranks)
    # others_read: every owner-stage rank builds what it broadcasts (PP > 1), else whether another TP rank receives
    # experts laid out apart come as fresh tensors (their gather is not lent): the whole call then lends nothing
    others_read, lending = agree_on_lending(plan, tp_group, receive, lend and plan.experts is None, dtype, pp)
    entries = [pe for pe in plan.entries if not (pe.mapping.megatron == "output_layer.weight" and plan.dims.tied)]

    if lending:
        yield from lent_buckets(
            entries,
            by_name,
            plan,
            bucket_bytes=bucket_bytes,
            write=others_read or receive,
            receive=receive,
            lend=lend,
            dtype=dtype,
            include_lm_head=include_lm_head,
        )
        return

    def stream():
        def gather_rounds(run: list[PlanEntry]) -> Iterator[list[PlanEntry]]:
            return rounds(run, plan, round_slot_bytes(plan))

        for batch in with_expert_items(entries, plan.dims, plan.experts, gather_rounds):
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
                yield from with_lm_head(pe, tensors, plan.dims, include_lm_head)

    yield from bucketed(stream(), lambda item: item[1], bucket_bytes)


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
    pp_group = parallel_groups().pp_group
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

    yield from bucketed(stream(), lambda s: s.tensor, bucket_bytes)
