"""Lending: the export's buckets as views of shared memory instead of fresh tensors (`bridge/export.py`'s
``export_hf_weights(..., lend=True)``; TP ranks on one host, PP=1).

Every rank writes the HF pieces of its own shards straight into one shared output slot, laid out as the fresh buffers
are (bridge/export_plan.py), and receivers get views of that slot instead of copies. The re-layout is then split
across the TP ranks, and a rank that only serves (``receive=False``) lays out the next round while the receivers
consume this one; a bucket holds whole parameters.

Two kinds of slots (`ExportPlan.lend_whole`, agreed by the TP group on every call):

- parameters in host memory (a CPU actor): a slot holds one whole call's tensors and two slots alternate between
  calls, so a lent tensor stays valid until this rank's next call but one. A consumer that keeps lent tensors past
  that (the CPU engine computing with them: no copy at all) holds their slot (`bridge/lent_slots.py`); calls then
  write the other slot, and lend nothing while every slot is held by some rank;
- elsewhere (device parameters, whose host copy is only a hand-over): a slot holds one round and two alternate
  between rounds, so /dev/shm holds two buckets, not two models. A lent tensor is then valid only until this rank
  asks for the next bucket, and a consumer copies what it keeps.

`agree_on_lending` is the per-call agreement (a collective over the TP group); `lent_buckets` yields the call's
buckets when the group lends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.export_plan import (
    ExportPlan,
    HFTensors,
    PlanEntry,
    hf_bytes,
    hf_views,
    round_slot_bytes,
    rounds,
    with_lm_head,
    write_pieces,
)
from megatron_rlvr.bridge.lent_slots import LENDING_SEGMENTS, held_slots
from megatron_rlvr.bridge.shm_exchange import ShmExchange


def agree_on_lending(
    plan: ExportPlan, tp_group, receive: bool, lend: bool, dtype: torch.dtype | None, pp: int
) -> tuple[bool, bool]:
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
        largest = max(hf_bytes(pe, plan, dtype) for pe in plan.entries)
        if whole:
            need = sum(hf_bytes(pe, plan, dtype) for pe in plan.entries)
        else:
            need = max(plan.tp * round_slot_bytes(plan), largest)
        if plan.lend_exchange is None or plan.lend_exchange.slot_bytes < need:  # the same decision on every rank
            old = plan.lend_exchange
            if old is not None:
                LENDING_SEGMENTS.pop(old.segments[0].data_ptr(), None)
            plan.lend_exchange = ShmExchange.open(tp_group, plan.tp_rank, need)
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


def _lent_round(
    batch: list[PlanEntry],
    by_name: dict[str, torch.Tensor],
    plan: ExportPlan,
    write: bool,
    read: bool,
    dtype: torch.dtype | None,
    offset: int,
) -> tuple[list[HFTensors], int]:
    """Each rank writes the HF pieces of its own shards (TP rank 0 also the replicated tensors) into this call's
    shared slot from byte ``offset`` on, one barrier, then every receiver takes views of the slot. The slot holds each
    entry's HF tensors back to back, as a fresh buffer does. Returns the tensors and the offset after them."""
    exchange = plan.lend_exchange
    segment = exchange.segments[0]
    out = []
    for pe in batch:
        nbytes = hf_bytes(pe, plan, dtype)
        outs = hf_views(pe, plan, segment[offset : offset + nbytes].view(dtype or pe.dtype))
        offset += nbytes
        if write and (pe.mapping.tp_dim is not None or plan.tp_rank == 0):
            write_pieces(pe, outs, by_name[pe.mapping.megatron].detach(), plan.tp_rank, plan)
        out.append(list(outs.items()))
    dist.barrier(group=exchange.group)  # every rank has written this round; the next call writes the other slot
    return (out if read else [[] for _ in batch]), offset


def lent_buckets(
    entries: list[PlanEntry],
    by_name: dict[str, torch.Tensor],
    plan: ExportPlan,
    *,
    bucket_bytes: int,
    write: bool,
    receive: bool,
    lend: bool,
    dtype: torch.dtype | None,
    include_lm_head: bool,
) -> Iterator[HFTensors]:
    """The buckets of a call the TP group agreed to lend (`agree_on_lending`), one per round: laid out one after
    another in this call's slot (whole-call slots), or each round in the other slot. ``write``: this rank writes its
    pieces (some rank reads them); ``lend``: this rank takes the views, else copies of them."""

    def size_of(pe: PlanEntry, plan: ExportPlan) -> int:
        return hf_bytes(pe, plan, dtype)

    slot_bytes = plan.lend_exchange.slot_bytes
    offset = plan.lend_slot * slot_bytes
    for batch in rounds(entries, plan, min(bucket_bytes, slot_bytes), size_of):
        if not plan.lend_whole:
            offset = (plan.rounds_done % 2) * slot_bytes
            plan.rounds_done += 1
        built, offset = _lent_round(batch, by_name, plan, write, receive, dtype, offset)
        if receive:
            bucket = [
                item
                for pe, tensors in zip(batch, built)
                for item in with_lm_head(pe, tensors, plan.dims, include_lm_head)
            ]
            yield bucket if lend else [(n, t.clone()) for n, t in bucket]
