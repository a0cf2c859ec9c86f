"""Separate placement: one torchrun world split into actor ranks and engine ranks, and the messages between them.

`split_roles` gives each role a default process group of its own (megatron-core then spans the actor ranks only)
and builds the cross groups that join actor rank 0 with the engine ranks: one for the weight transfer (NCCL on GPU,
gloo on CPU), one over gloo for pickled objects (commands, experience). The send/recv/broadcast helpers move those
objects. Colocated runs never import this module; `distributed` stays the one place for the world and megatron-core's
parallel state, which this module builds on.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rlvr.runtime.distributed import backend, init_process_group

# How long a peer across the role split may stay silent (an engine's generation included) before the wait raises.
ROLE_TIMEOUT_S = 1800.0
_splits = 0  # role splits made in this process: each takes keys of its own in the store
_whole_world: tuple[Any, int, int, float] | None = None  # (store, rank, size, timeout) while the world is split


@dataclass
class Roles:
    """This rank's side of the split world (`split_roles`).

    The default process group is the role's own world afterwards: the actor's ranks 0..A-1 (megatron-core's parallel
    state spans it) or the engines' ranks 0..E-1 (rollout-DP and reward scoring span it). ``cross`` joins actor
    rank 0 (member 0) with the engine ranks (members 1..E) for the weight transfer (NCCL on GPU, gloo on CPU);
    ``cross_objects`` is the same membership over gloo for pickled objects (commands, experience). Both are None on
    actor ranks other than 0. They are group objects unknown to the default world: use their own methods."""

    role: Literal["actor", "engine"]
    global_rank: int
    global_world: int
    engine_ranks: int
    cross: Any = None
    cross_objects: Any = None

    @property
    def actor_ranks(self) -> int:
        return self.global_world - self.engine_ranks

    @property
    def is_engine(self) -> bool:
        return self.role == "engine"

    def describe(self, cross_rank: int) -> str:
        """The global rank of cross-group member ``cross_rank`` (for messages about a peer)."""
        return f"rank {0 if cross_rank == 0 else self.actor_ranks + cross_rank - 1}"


def split_roles(engine_ranks: int, timeout_s: float = ROLE_TIMEOUT_S) -> Roles:
    """Split the torchrun world: the last ``engine_ranks`` ranks serve rollout engines, the others are the actor.
    A collective over the whole world; afterwards ``dist`` calls see the role's own world (see `Roles`).

    Each role re-initializes the default group from the world's store under a prefix of its own, so megatron-core's
    `initialize_model_parallel` spans the actor ranks only; the cross groups are built directly on that store."""
    global _splits, _whole_world
    init_process_group(timeout_s)
    from torch.distributed import distributed_c10d as c10d

    if _whole_world is not None:
        raise RuntimeError("split_roles: the world is split already (unsplit_roles first)")
    store = c10d._get_default_store()
    grank, world = dist.get_rank(), dist.get_world_size()
    _whole_world = (store, grank, world, timeout_s)
    if not 0 < engine_ranks < world:
        raise ValueError(f"rollout.engine_ranks={engine_ranks}: expected 1 .. world size - 1 = {world - 1}")
    _splits += 1
    tag = f"megatron-rlvr/split-{_splits}"
    actors = world - engine_ranks
    is_engine = grank >= actors
    dist.barrier()  # every rank is done with the world group before it goes
    dist.destroy_process_group()
    role: Literal["actor", "engine"] = "engine" if is_engine else "actor"
    local = grank - actors if is_engine else grank
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend(),
        store=dist.PrefixStore(f"{tag}/{role}/", store),
        rank=local,
        world_size=engine_ranks if is_engine else actors,
        timeout=timeout,
    )
    roles = Roles(role, grank, world, engine_ranks)
    if is_engine or grank == 0:
        cross_rank, size = (1 + local if is_engine else 0), 1 + engine_ranks
        roles.cross_objects = _gloo_group(dist.PrefixStore(f"{tag}/cross-objects/", store), cross_rank, size, timeout)
        roles.cross = (
            _nccl_group(dist.PrefixStore(f"{tag}/cross/", store), cross_rank, size, timeout)
            if torch.cuda.is_available()
            else roles.cross_objects
        )
    return roles


def unsplit_roles() -> None:
    """Undo `split_roles` (tests, tools that go on in the same processes): the default group is the whole world
    again, under keys of its own; the cross groups of the split must not be used afterwards."""
    global _whole_world
    if _whole_world is None:
        return
    store, grank, world, timeout_s = _whole_world
    _whole_world = None
    dist.destroy_process_group()
    dist.init_process_group(
        backend=backend(),
        store=dist.PrefixStore(f"megatron-rlvr/split-{_splits}/world/", store),
        rank=grank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.barrier()


def _gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def send_object(group: Any, obj: Any, dst: int, tag: int = 0) -> int:
    """Pickle ``obj`` to member ``dst`` of a (gloo) group object; returns the bytes sent. Raises when the peer is
    gone or silent past the group's timeout."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    group.send([torch.tensor([len(data)], dtype=torch.int64)], dst, tag).wait()
    group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, tag).wait()
    return len(data)


def recv_object(group: Any, src: int, tag: int = 0) -> Any:
    """The object `send_object` sent from member ``src``."""
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], src, tag).wait()
    buf = torch.empty(int(size), dtype=torch.uint8)
    group.recv([buf], src, tag).wait()
    return pickle.loads(buf.numpy().tobytes())


def broadcast_object(group: Any, obj: Any = None, root: int = 0) -> Any:
    """``obj`` from member ``root`` of a (gloo) group object to every member; returns it on every member."""
    size = torch.empty(1, dtype=torch.int64)
    if group.rank() == root:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size[0] = len(data)
    group.broadcast(size, root).wait()
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if group.rank() == root
        else torch.empty(int(size), dtype=torch.uint8)
    )
    group.broadcast(buf, root).wait()
    return obj if group.rank() == root else pickle.loads(buf.numpy().tobytes())


class ObjectListener:
    """The receiving end of `broadcast_object` from member ``root``, without waiting: `arrived` polls between units
    of other work (an engine step), `take` then reads the object. The receive of the next object is posted at the
    first `arrived` after a `take`; the group must carry nothing else meanwhile but point-to-point messages."""

    def __init__(self, group: Any, root: int = 0) -> None:
        self.group, self.root = group, root
        self._size: torch.Tensor | None = None
        self._work: Any = None

    def arrived(self) -> bool:
        if self._work is None:
            self._size = torch.empty(1, dtype=torch.int64)
            self._work = self.group.broadcast(self._size, self.root)
        return bool(self._work.is_completed())

    def wait(self) -> None:
        """Until the next object arrives (up to the group's timeout); `take` then reads it."""
        self.arrived()
        self._work.wait()

    def take(self) -> Any:
        """The next object (waits for it, up to the group's timeout)."""
        self.wait()
        buf = torch.empty(int(self._size), dtype=torch.uint8)
        self._work = None
        self.group.broadcast(buf, self.root).wait()
        return pickle.loads(buf.numpy().tobytes())


def pin_cpu_cores() -> list[int]:
    """Separate placement on CPU: give this process its own share of the host's cores (by LOCAL_RANK), so that an
    engine rank and an actor rank do not run on the same cores and an overlap measures overlap, not contention.
    vLLM's in-process CPU engine inherits the affinity (VLLM_CPU_OMP_THREADS_BIND is set to the same cores for
    vLLM's own binding). Returns the cores; none pinned (empty) on GPU, or with fewer cores than local ranks."""
    if torch.cuda.is_available() or not hasattr(os, "sched_setaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    share = len(cores) // local_world
    if share < 1 or local_rank >= local_world:
        return []
    mine = cores[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    torch.set_num_threads(len(mine))
    return mine
