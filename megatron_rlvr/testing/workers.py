"""Run a function on every rank of a gloo process group, with a hard timeout; used by tests and CPU benchmarks.

A `WorkerGroup` spawns `world_size` processes once (torch.distributed initialized over gloo) and then runs many
calls on them, because starting a process that imports megatron.core costs seconds. A call that raises on any rank,
or does not finish within its timeout, kills the whole group (workers and anything they spawned) and raises here
with the failing rank's traceback; the next call starts a fresh group. Workers also die with their parent
(PR_SET_PDEATHSIG), so a killed test run leaves no orphans.

`fork_from_a_preloaded_server()` (the test session's choice) makes every later group fork its workers from one
server process that imported torch, megatron.core and transformers once, instead of spawning interpreters that
import them again: ~6 s of CPU saved per worker. A forked worker is as fresh as a spawned one (the server runs
nothing but the imports) and gets this process's environment, working directory and sys.path at its start; only
what those imports read from the environment comes from the server's start. Its parent is the server, which exits
with this process, so the death signal still reaches it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import psutil
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rlvr.runtime.ports import free_port


class WorkerError(RuntimeError):
    """A worker raised, died, or the group did not answer within the timeout."""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent's cleanup is all we have
        pass


# The audit event (`sys.audit`) raised when a group starts its processes: how a test harness sees it (tests/tiers.py)
WORKER_GROUP_EVENT = "megatron_rlvr.testing.worker_group"

# How groups start their workers: "spawn" (fresh interpreters), or "forkserver" once fork_from_a_preloaded_server ran.
_start_method = "spawn"
PRELOAD = ("torch", "megatron.core", "transformers", "megatron_rlvr.runtime.distributed")


def fork_from_a_preloaded_server(modules: tuple[str, ...] = PRELOAD) -> None:
    """From now on this process's groups fork their workers from a server that imported ``modules`` once.

    Call it before the first group starts. Not for memory measurements: a forked worker's heap starts as the
    server's. Modules that read the environment when imported (vLLM's logging) are better left out."""
    global _start_method
    mp.get_context("forkserver").set_forkserver_preload(list(modules))
    _start_method = "forkserver"


def _let_go_of_the_fork_server() -> None:
    """A worker forked by the server holds the write end of the server's "alive" pipe, as every client does, and
    the server runs until the last holder closes it: held here, a killed test run would leave the server and its
    workers (whose parent it is) alive for good. Closed, the server exits with the test run and the workers die
    with it (PR_SET_PDEATHSIG)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the stdlib's one server per process; no public handle to this fd
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _worker_main(
    rank: int, world_size: int, port: int, conn: Connection, environ: dict[str, str], env: dict[str, str]
) -> None:
    _die_with_parent()
    _let_go_of_the_fork_server()  # a spawned worker holds nothing of it
    os.environ.clear()  # the group's creator's environment at the start (a forked worker has the server's)
    os.environ.update(environ)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import warnings

    # megatron-core warns at import time that the optional GPU libraries are missing, once per process
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
    import torch

    torch.set_num_threads(max(1, int(env.get("MEGATRON_RLVR_WORKER_THREADS", "1"))))
    from megatron_rlvr.runtime import distributed
    from megatron_rlvr.testing.gloo_device import share_one_gloo_device

    share_one_gloo_device()  # an idle worker must not wake 100 times a second per process group it holds
    distributed.init_process_group()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            conn.send(("error", traceback.format_exc()))


class WorkerGroup:
    """`world_size` gloo worker processes that run importable functions on request."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        sys.audit(WORKER_GROUP_EVENT, self.world_size)
        ctx = mp.get_context(_start_method)
        port = free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            # Not daemonic: megatron's dist checkpointing starts a multiprocessing Manager inside workers, which
            # daemonic processes may not do; close() and PR_SET_PDEATHSIG take care of the cleanup instead.
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child, dict(os.environ), self.env),
                name=f"megatron-rlvr-worker-{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise WorkerError(
                    f"{getattr(fn, '__qualname__', fn)} did not finish within {timeout:.0f} s on ranks "
                    f"{sorted(pending)} (a hang, e.g. a collective some rank never joined); the group was killed"
                )
            for conn in wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    code = self._procs[rank].exitcode
                    self.close()
                    raise WorkerError(f"worker rank {rank} died (exit code {code}) while running {fn}") from None
                if status == "error":
                    self.close()
                    raise WorkerError(f"rank {rank} raised while running {getattr(fn, '__qualname__', fn)}:\n{value}")
                results[rank] = value
                del pending[rank]
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers and everything they started. Safe to call twice."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        victims: list[psutil.Process] = []
        for proc in self._procs:
            try:
                p = psutil.Process(proc.pid)
                victims.extend(p.children(recursive=True))
                victims.append(p)
            except psutil.NoSuchProcess:
                pass
        for proc in self._procs:
            proc.join(timeout=2)
        for victim in victims:
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create while active and that are still alive: the CPU benchmarks' memory
    accounting (``with LiveBytes() as t: ...; t.peak``), the counterpart of ``torch.cuda.max_memory_allocated``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: only storages no input has are new memory
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self._seen and key not in inputs and storage.nbytes() > 0:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        return out
