"""Weight transfer from the actor to engines on ranks of their own, over a process group of their own.

Member 0 of ``group`` is the sender (one actor rank; every actor rank still iterates the export, a collective), members
1..E are the engine ranks. Each message (one bucket of the export, split further only if it is over the bound) goes
out as two broadcasts from member 0, so one or many engine ranks cost the sender the same on NCCL:

1. a header, int64 ``[MAGIC, metadata bytes, payload bytes, version]``;
2. one uint8 buffer: the metadata (JSON: version, message index, ``last`` flag, each tensor's name, dtype and shape),
   then the tensors flattened per dtype, each dtype's run 64-byte aligned and the tensors of one run back to back
   (so q/k/v of a layer stay adjacent, as the export lays them out).

A transfer ends with an empty message whose ``last`` flag is set. Every engine rank slices its engine-TP shard on
receipt (``bridge/reshard.py``); the bytes on the wire are the full tensors, one broadcast for all.

Handshakes name a dead or silent member. Before each message an engine rank sends member 0 a small "ready" message
(the transfer count and message index, point to point), so member 0 waits on each member by name before it
broadcasts; after the terminator each engine rank sends "done", so ``send`` returns once every engine rank has
consumed the whole stream. Every wait has a deadline: ``timeout_s`` within a transfer, ``wait_s`` for its start (an
engine may still be generating, the actor still training). On gloo each operation carries that deadline
(``BroadcastOptions.timeout``, ``Work.wait(timeout)``) and a timeout or a closed connection raises at once; after
that the group is broken (gloo closes every pair) and both classes refuse further use. On NCCL the same deadlines are
handed to ProcessGroupNCCL (the watchdog aborts an operation that passes its timeout; a ``wait`` with a timeout blocks
the CPU until completion or raises) - not exercised here, since NCCL needs a device per member. A member that dies
in the middle of a broadcast is reported by that broadcast's failure (gloo names the peer's address, not its member
number); one that dies between messages is named by the next handshake.

Buffers: the sender packs into two alternating byte buffers (a broadcast proceeds while the export builds the next
bucket), the engine ranks receive into one, each grown to the largest message: a transfer holds at most one bucket
per engine rank and two on the sender.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.export import DEFAULT_BUCKET_BYTES
from megatron_rlvr.bridge.reshard import engine_shard
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rollout.base import RolloutEngine

MAGIC = 0x57E1647  # first word of every header: a member out of step reads garbage instead of a header
_TAG_READY = 731  # point-to-point tag of the handshakes (gloo; NCCL ignores tags)
_ALIGN = 64
DEFAULT_TIMEOUT_S = 300.0


class TransferError(RuntimeError):
    """A member died, did not answer within the deadline, or is out of step; the message names the member."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"weight transfer: unknown dtype {name!r} in a message's metadata")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(items: list[tuple[str, str, list[int]]], start: int) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte count) of each item in the payload and the payload's end: tensors grouped by dtype (in
    order of first appearance), each group aligned, the tensors of a group back to back."""
    order: dict[str, list[int]] = {}
    for i, (_, dtype, _) in enumerate(items):
        order.setdefault(dtype, []).append(i)
    places: list[tuple[int, int]] = [(0, 0)] * len(items)
    offset = start
    for dtype, members in order.items():
        offset = _aligned(offset)
        size = _dtype(dtype).itemsize
        for i in members:
            nbytes = size * int(torch.Size(items[i][2]).numel())
            places[i] = (offset, nbytes)
            offset += nbytes
    return places, offset


class _Link:
    """The group's operations with deadlines and member-naming errors; broken after the first failure."""

    def __init__(self, group, timeout_s: float, device: torch.device | str | None, role: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"weight transfer: timeout_s must be positive, got {timeout_s}")
        self.group, self.timeout_s, self.role = group, float(timeout_s), role
        self.size, self.rank = group.size(), group.rank()
        if self.size < 2:
            raise ValueError(
                f"weight transfer: the group has {self.size} member(s); expected the sender and >= 1 engine rank"
            )
        backend = group.name() if hasattr(group, "name") else "gloo"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.broken: str | None = None
        try:
            self.global_ranks = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - a group built from a store is not registered with the default world
            self.global_ranks = None

    def who(self, member: int) -> str:
        role = "the sender" if member == 0 else "an engine rank"
        where = f", global rank {self.global_ranks[member]}" if self.global_ranks else ""
        return f"member {member} ({role}{where})"

    def check(self) -> None:
        if self.broken:
            raise TransferError(f"weight transfer: the group broke earlier and cannot be used again ({self.broken})")

    def wait(self, work, what: str, timeout_s: float) -> None:
        try:
            ok = work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError or DistBackendError
            self.broken = f"{self.role}: {what}: {e}"
            how = (
                f"no answer within {timeout_s:g} s"
                if "timed out" in str(e).lower()
                else "the connection failed (the peer died?)"
            )
            raise TransferError(f"weight transfer ({self.role}, member {self.rank}): {what}: {how}: {e}") from e
        if ok is False:  # NCCL may report a timeout by returning False
            self.broken = f"{self.role}: {what}: timed out"
            raise TransferError(
                f"weight transfer ({self.role}, member {self.rank}): {what}: no answer within {timeout_s:g} s"
            )

    def broadcast(self, tensor: torch.Tensor, timeout_s: float):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        return self.group.broadcast([tensor], opts)


def _hand(count: int, index: int) -> torch.Tensor:
    return torch.tensor([MAGIC, count, index], dtype=torch.int64)


class WeightSender:
    """On member 0: sends each transfer (a stream of buckets with its weight version) to every engine rank.

    ``bucket_bytes``: a bucket over it is cut (the export's own bound, so normally nothing is). ``device``: where the
    buffers live; default CUDA for an NCCL group, CPU otherwise (give it for a group with several backends). Extra
    keyword arguments beyond the agreed API: ``bucket_bytes``, ``device``, and ``send(..., wait_s=)``."""

    def __init__(
        self,
        group,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
    ) -> None:
        self.link = _Link(group, timeout_s, device, "sender")
        if self.link.rank != 0:
            raise ValueError(
                f"WeightSender: must be member 0 of the transfer group, this process is member {self.link.rank}"
            )
        if bucket_bytes <= 0:
            raise ValueError(f"WeightSender: bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.count = 0  # transfers completed
        self.last_version: int | None = None
        self._slots: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=self.link.device)] * 2

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the send buffers (at most two of the largest message)."""
        return sum(s.numel() for s in self._slots)

    def _split(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets as they come, a bucket over ``bucket_bytes`` cut into consecutive runs within it (one larger
        tensor goes alone). Never merges buckets: a lent bucket is packed before the next is asked for."""
        for bucket in buckets:
            run: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in bucket:
                nbytes = tensor.numel() * tensor.element_size()
                if run and size + nbytes > self.bucket_bytes:
                    yield run
                    run, size = [], 0
                run.append((name, tensor))
                size += nbytes
            if run:
                yield run

    def _pack(self, items: list[tuple[str, torch.Tensor]], version: int, index: int, last: bool, slot: int):
        meta = json.dumps(
            {
                "version": version,
                "index": index,
                "last": last,
                "items": [(n, str(t.dtype), list(t.shape)) for n, t in items],
            }
        ).encode()
        places, end = _layout([(n, str(t.dtype), list(t.shape)) for n, t in items], len(meta))
        if self._slots[slot].numel() < end:
            self._slots[slot] = torch.empty(end, dtype=torch.uint8, device=self.link.device)
        buf = self._slots[slot][:end]
        buf[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        for (_, tensor), (offset, nbytes) in zip(items, places):
            buf[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        payload = sum(nbytes for _, nbytes in places)
        header = torch.tensor([MAGIC, len(meta), end, version], dtype=torch.int64, device=self.link.device)
        return header, buf, payload

    def _post_hands(self, index: int) -> list[tuple[int, torch.Tensor, object]]:
        hands = []
        for member in range(1, self.link.size):
            t = torch.empty(3, dtype=torch.int64, device=self.link.device)
            hands.append((member, t, self.link.group.recv([t], member, _TAG_READY)))
        return hands

    def _await_hands(self, hands, index: int, version: int, timeout_s: float, what: str) -> None:
        for member, t, work in hands:
            self.link.wait(work, f"waiting for {self.link.who(member)} to be {what} (version {version})", timeout_s)
            got = t.tolist()
            if got != _hand(self.count, index).tolist():
                self.link.broken = f"{self.link.who(member)} out of step"
                raise TransferError(
                    f"weight transfer: {self.link.who(member)} is out of step: it answered {got[1:]} (transfers done, "
                    f"message) where the sender is at {[self.count, index]}; did it stop reading a stream early?"
                )

    def send(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, *, wait_s: float | None = None
    ) -> dict[str, float]:
        """Send one transfer; returns once every engine rank has consumed it. ``version`` must grow from transfer to
        transfer. ``wait_s``: how long the engine ranks may take to start receiving (default ``timeout_s``).
        Returns bytes of tensors sent (once, whatever the number of engine ranks), seconds, messages (buckets) and the
        largest message's tensor bytes."""
        link = self.link
        link.check()
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(
                f"WeightSender.send: version {version} after version {self.last_version}; versions must grow"
            )
        start = time.perf_counter()
        sent, largest, index, in_flight = 0, 0, 0, [None, None]
        hands = self._post_hands(0)
        messages = self._split(buckets)
        while True:
            items = next(messages, None)
            last = items is None
            slot = index % 2
            if in_flight[slot] is not None:  # the broadcast that last used this slot has finished
                for work in in_flight[slot]:
                    link.wait(work, f"broadcast of message {index - 2} (version {version})", link.timeout_s)
            header, buf, payload = self._pack(items or [], version, index, last, slot)
            self._await_hands(
                hands,
                index,
                version,
                (wait_s or link.timeout_s) if index == 0 else link.timeout_s,
                f"ready for message {index}",
            )
            hands = self._post_hands(-1 if last else index + 1)
            in_flight[slot] = [link.broadcast(header, link.timeout_s), link.broadcast(buf, link.timeout_s)]
            sent, largest = sent + payload, max(largest, payload)
            index += 1
            if last:
                break
        for works in in_flight:
            for work in works or ():
                link.wait(work, f"broadcast of the last messages (version {version})", link.timeout_s)
        self._await_hands(hands, -1, version, link.timeout_s, "done")
        self.count += 1
        self.last_version = version
        return {
            "transfer/bytes": float(sent),
            "transfer/seconds": time.perf_counter() - start,
            "transfer/buckets": float(index - 1),
            "transfer/max_bucket_bytes": float(largest),
        }


class WeightReceiver:
    """On each engine rank: receives each transfer and yields its tensors (full, or this rank's engine-TP shard).

    Extra keyword arguments beyond the agreed API: ``timeout_s``, ``device`` (as the sender's) and
    ``receive(wait_s=)``."""

    def __init__(
        self,
        group,
        *,
        engine_tp: int,
        engine_tp_rank: int,
        dims: ModelDims | None,
        shard: bool,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
    ) -> None:
        self.link = _Link(group, timeout_s, device, "engine")
        if self.link.rank == 0:
            raise ValueError("WeightReceiver: member 0 of the transfer group is the sender")
        if not 0 <= engine_tp_rank < engine_tp:
            raise ValueError(f"WeightReceiver: engine_tp_rank {engine_tp_rank} not in [0, {engine_tp})")
        if shard and dims is None:
            raise ValueError("WeightReceiver: shard=True needs the model's dims (ModelDims.from_hf)")
        self.engine_tp, self.engine_tp_rank, self.dims, self.shard = engine_tp, engine_tp_rank, dims, shard
        self.count = 0  # transfers completed
        self.last_version: int | None = None
        self._open = False
        self._version: int | None = None  # the transfer in progress
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.link.device)
        self._header = torch.empty(4, dtype=torch.int64, device=self.link.device)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the receive buffer (the largest message so far)."""
        return self._buffer.numel()

    def _hand(self, index: int):
        return self.link.group.send([_hand(self.count, index).to(self.link.device)], 0, _TAG_READY)

    def _message(self, index: int, timeout_s: float) -> tuple[dict, torch.Tensor, int]:
        """Announce readiness for message ``index`` and receive it: (metadata, buffer, metadata bytes)."""
        link, sender = self.link, self.link.who(0)
        of = f"message {index} of version {self._version}" if index else "the next transfer's first message"
        hand = self._hand(index)
        link.wait(link.broadcast(self._header, timeout_s), f"waiting for {sender} to send {of}", timeout_s)
        link.wait(hand, f"handshake with {sender} before {of}", link.timeout_s)
        magic, meta_len, end, self._version = self._header.tolist()
        of = f"message {index} of version {self._version}"
        if magic != MAGIC:
            link.broken = "bad header"
            raise TransferError(f"weight transfer: message {index} from {sender} has no valid header (out of step)")
        if self._buffer.numel() < end:
            self._buffer = torch.empty(end, dtype=torch.uint8, device=link.device)
        buf = self._buffer[:end]
        link.wait(link.broadcast(buf, link.timeout_s), f"receiving {of} from {sender}", link.timeout_s)
        meta = json.loads(bytes(buf[:meta_len].cpu().numpy()))
        if meta["index"] != index:
            link.broken = "out of step"
            raise TransferError(f"weight transfer: expected message {index}, {sender} sent {meta['index']}")
        return meta, buf, meta_len

    def receive(self, *, wait_s: float | None = None) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(version, stream of (hf_name, tensor)). Consume the stream to its end before the next ``receive``. A tensor
        is a view of the receive buffer, valid until the stream moves into the next message (at least until the next
        item is drawn): copy what must outlive that. ``wait_s``: how long to wait for the transfer to start (the
        actor may still be training; default ``timeout_s``)."""
        self.link.check()
        if self._open:
            raise TransferError("WeightReceiver.receive: the previous stream was not consumed to its end")
        meta, buf, meta_len = self._message(0, wait_s or self.link.timeout_s)
        version = meta["version"]
        if self.last_version is not None and version <= self.last_version:
            self.link.broken = "version out of order"
            raise TransferError(f"weight transfer: version {version} arrived after version {self.last_version}")
        self._open = True
        return version, self._stream(meta, buf, meta_len)

    def _stream(self, meta: dict, buf: torch.Tensor, meta_len: int) -> Iterator[tuple[str, torch.Tensor]]:
        index = 0
        while not meta["last"]:
            items = [(n, d, s) for n, d, s in meta["items"]]
            places, _ = _layout(items, meta_len)
            for (name, dtype, shape), (offset, nbytes) in zip(items, places):
                full = buf[offset : offset + nbytes].view(_dtype(dtype)).view(shape)
                if self.shard:
                    yield name, engine_shard(name, full, self.dims, self.engine_tp, self.engine_tp_rank)
                else:
                    yield name, full
            index += 1
            meta, buf, meta_len = self._message(index, self.link.timeout_s)
        done = f"telling {self.link.who(0)} version {self._version} is done"
        self.link.wait(self._hand(-1), done, self.link.timeout_s)
        self.count += 1
        self.last_version = meta["version"]
        self._open = False


def load_weights(engine: RolloutEngine, receiver: WeightReceiver) -> int:
    """Receive one transfer into ``engine``; returns its weight version. The stream is read to its end whatever
    the engine made of it (the sender waits for every engine rank to finish it).

    Each tensor is copied as it arrives: the receiver's views live only until the next item, while the engine's
    lent path (``lent=True``) keeps the parts of a packed weight (q/k/v) until the last one arrives, which holds for
    the bridge's buckets but not for the transfer's messages (with actor PP=2 q and k/v came in different messages
    and q was overwritten)."""
    version, stream = receiver.receive()
    try:
        engine.update_weights(((name, tensor.clone()) for name, tensor in stream), lent=False)
    finally:
        for _ in stream:
            pass
    return version
