"""Shared-memory exchange between the TP ranks of one host, for the bridge's export (`bridge/export.py`): each rank
maps a /dev/shm segment of two slots and every peer's segment."""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

_SHM_DIR = "/dev/shm"
_ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ShmExchange:
    """The TP gather for ranks on one host, through shared memory instead of gloo's TCP copies.

    Each rank maps a /dev/shm segment of two slots and every peer's segment. A round: each rank writes its shards
    into its current slot (skipped when no other rank receives), one barrier, then receivers read every rank's
    shards in place -- the re-layout's reads are the gather. Slots alternate, so a rank overwrites a slot only after
    the next round's barrier, which every reader reaches after it is done reading that slot. The files are unlinked
    once every rank has mapped them: nothing is left behind if a process dies.
    """

    def __init__(self, segments: list[torch.Tensor], slot_bytes: int, rank: int, group) -> None:
        self.segments, self.slot_bytes, self.rank, self.group = segments, slot_bytes, rank, group

    @classmethod
    def open(cls, group, rank: int, slot_bytes: int) -> ShmExchange | None:
        """Collective over ``group``; None on every rank unless every rank mapped every segment (another host, or
        another IPC namespace: each rank checks a token written by the segment's owner)."""
        token = secrets.token_hex(8)
        path = os.path.join(_SHM_DIR, f"megatron_rlvr_export_{token}")
        mine: tuple[str, str] | None = None
        try:
            fs = os.statvfs(_SHM_DIR)
            if fs.f_bavail * fs.f_frsize < 2 * slot_bytes:  # a write past a full tmpfs is a SIGBUS, not an error
                raise OSError(f"{_SHM_DIR} has less than {2 * slot_bytes} bytes free")
            with open(path, "wb") as f:
                f.truncate(2 * slot_bytes)
            seg = torch.from_file(path, shared=True, size=2 * slot_bytes, dtype=torch.uint8)
            seg[:16].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
            mine = (path, token)
        except (OSError, RuntimeError):  # no (or too small a) /dev/shm here: every rank falls back
            seg = None
        owners: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(owners, mine, group=group)
        segments: list[torch.Tensor] = []
        ok = all(o is not None for o in owners)
        for r, owner in enumerate(owners if ok else []):
            try:
                peer = seg if r == rank else torch.from_file(owner[0], True, 2 * slot_bytes, dtype=torch.uint8)
                ok = ok and bytes(peer[:16].tolist()) == owner[1].encode()
                segments.append(peer)
            except (OSError, RuntimeError):
                ok = False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # also: every rank has mapped, unlink is safe
        if mine is not None:
            os.unlink(path)
        return cls(segments, slot_bytes, rank, group) if flag.item() else None

    def round(self, shards: list[torch.Tensor], slot: int, write: bool, read: bool) -> list[list[torch.Tensor]]:
        """Every rank's copy of each shard (same shapes on every rank): ``out[i][r]`` is rank r's ``shards[i]``."""
        views: list[list[torch.Tensor]] = [[] for _ in shards]
        for seg in self.segments:
            offset = slot * self.slot_bytes
            for i, shard in enumerate(shards):
                nbytes = shard.numel() * shard.element_size()
                views[i].append(seg[offset : offset + nbytes].view(shard.dtype).view(shard.shape))
                offset += aligned(nbytes)
        if write:
            for i, shard in enumerate(shards):
                views[i][self.rank].copy_(shard)
        dist.barrier(group=self.group)
        if not read:
            return []
        for i, shard in enumerate(shards):
            views[i][self.rank] = shard  # its own shard: read in place, written only for the peers
        return views
