"""Lending slots of the bridge's export held by consumers that keep lent tensors (`bridge/export_lending.py`).

A lending exchange has two slots of one whole export call each; calls alternate between them. A consumer that keeps
computing with lent tensors after the call (the CPU engine, which adopts them instead of copying) holds their slot
on its rank; the export then writes the other slot, and lends nothing while both are held by some rank of the TP
group. Holds count per rank and are process-local state (the export reads them in its per-call agreement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LentSlot:
    """One slot of a lending exchange on this rank (see the module docstring)."""

    exchange_id: int
    index: int


_HOLDS: dict[LentSlot, int] = {}  # slot -> holds on this rank
LENDING_SEGMENTS: dict[int, Any] = {}  # data_ptr of a lending segment on this rank -> its exchange


def lent_slot_of(tensor: torch.Tensor) -> LentSlot | None:
    """The lending slot ``tensor`` lies in entirely, or None (a fresh tensor)."""
    storage = tensor.untyped_storage()
    exchange = LENDING_SEGMENTS.get(storage.data_ptr())
    if exchange is None:
        return None
    start = tensor.data_ptr() - storage.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    index = start // exchange.slot_bytes
    if index > 1 or end > (index + 1) * exchange.slot_bytes:
        return None
    return LentSlot(id(exchange), int(index))


def hold_lent_slot(slot: LentSlot) -> None:
    """Keep later calls from writing ``slot`` until `release_lent_slot` (holds count; per rank)."""
    _HOLDS[slot] = _HOLDS.get(slot, 0) + 1


def release_lent_slot(slot: LentSlot) -> None:
    held = _HOLDS.get(slot, 0)
    if held <= 1:
        _HOLDS.pop(slot, None)
    else:
        _HOLDS[slot] = held - 1


def held_slots(exchange: Any) -> list[int]:
    return [] if exchange is None else [i for i in (0, 1) if _HOLDS.get(LentSlot(id(exchange), i))]
