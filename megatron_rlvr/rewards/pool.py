"""A pool of verifier processes that scores a batch and never stalls and never drops a sample.

Which verifier scores an item is `verifiers.VerifierTable.route`'s decision. Math, code, plugin, SynLogic and
reasoning-gym items go to worker processes (math-verify's timeouts use ``signal.alarm``, which only works in a
process's main thread, so the pool holds processes, not threads); countdown and generic logic are scored in-process.
Every item gets a reward: an item still running at its wall deadline has its worker SIGKILLed and replaced
(reward 0, ``timeouts`` += 1); a worker that dies mid-item (segfault, abort, OOM kill) is replaced (reward 0,
``crashes`` += 1); a verifier exception is reward 0, ``errors`` += 1, and its message is logged (and kept in
``last_errors``). Each batch also counts its items per verifier (``verifier/<name>``). The deadline clock starts when
the item is handed to a worker that has finished importing, and has done the verifier's one-time setup
(`VerifierTable.warm`: reasoning-gym's import), so a slow start never counts against an item.

Workers are started with the "spawn" method: forking a trainer that holds threads (torch, gloo) is unsafe.

Each worker may run one sandboxed program at a time, which may hold its memory budget plus its tmpfs; the pool checks
at start that ``workers`` of those fit in the machine's available memory, so that a batch of hostile programs can
never drive the node into its OOM killer (which might pick the trainer).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards import reasoning_gym
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.sandbox import SandboxUnavailableError
from megatron_rlvr.rewards.scoring import code_limits
from megatron_rlvr.rewards.verifiers import VerifierTable

log = logging.getLogger(__name__)

COUNTER_KEYS = ("items", "timeouts", "crashes", "errors")
_CODE_SLACK_S = 5.0
_MAX_START_FAILURES = 3  # consecutive workers dying before they are ready: a broken setup, not a bad item
_START_TIMEOUT_S = 300.0  # a worker not ready by then (imports stuck) counts as a failed start


def check_memory_fits(cfg: RewardConfig) -> None:
    """ConfigError naming the keys when ``workers`` sandboxes at their full budgets exceed the available memory."""
    import psutil

    per_program = cfg.code_memory_mb + cfg.code_tmpfs_mb
    memory = psutil.virtual_memory()
    available, total = memory.available >> 20, memory.total >> 20
    if cfg.workers * per_program > available:
        raise ConfigError(
            f"reward.workers ({cfg.workers}) x (reward.code_memory_mb ({cfg.code_memory_mb}) + reward.code_tmpfs_mb "
            f"({cfg.code_tmpfs_mb})) = {cfg.workers * per_program} MB of code-sandbox memory does not fit in this "
            f"machine's available memory ({available} MB of {total} MB); lower reward.workers or "
            f"reward.code_memory_mb, so that every worker's program can hold its whole budget at once"
        )


def _worker_main(
    conn: Connection, cfg: RewardConfig, extra_scorers: Mapping[str, Callable] | None, warm: Sequence[str] = ()
) -> None:
    # Slurm's warning signal (USR1) goes to every process of the job step; a verifier dying of it mid-item would
    # score that item 0. The trainer's ranks handle it (runtime/preemption.py); the workers ignore it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a verifier that aborts leaves no core file behind
    if cfg.worker_memory_mb > 0:
        limit = cfg.worker_memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import math_verify  # noqa: F401 - pay the sympy import before announcing readiness

    try:
        table = VerifierTable(cfg, extra_scorers)  # imports the plugins and the SynLogic checkout
    except Exception as exc:  # noqa: BLE001 - checked in the trainer already; a worker that differs says why
        conn.send(("setup_error", f"{type(exc).__name__}: {exc}"[:500]))
        return
    for verifier in warm:
        _warm(table, verifier)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "warm":
            conn.send(("warmed", _warm(table, message[1])))
            continue
        item_id, verifier, task, response, reference = message
        try:
            conn.send((item_id, table.score(verifier, task, response, reference), None))
        except SandboxUnavailableError as exc:  # not the item's fault: no program may run here, and none will
            conn.send(("refused", item_id, str(exc)))
        except Exception as exc:  # noqa: BLE001 - any verifier failure is reward 0 plus a counter, never a lost item
            conn.send((item_id, 0.0, f"{type(exc).__name__}: {exc}"[:500]))


def _warm(table: VerifierTable, verifier: str) -> str | None:
    try:
        table.warm(verifier)
        return None
    except Exception as exc:  # noqa: BLE001 - the items of that verifier will report it as their errors
        return f"{verifier}: {type(exc).__name__}: {exc}"[:500]


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    item: int | None = None
    deadline: float = 0.0
    started: float = 0.0
    warming: int = 0  # warm-up requests sent and not yet answered: no item is handed over until they are


class RewardPool:
    """Parallel scorer: ``with RewardPool(cfg) as pool: rewards, counters = pool.score_batch(tasks, responses, refs)``.

    ``extra_scorers`` maps additional task names to picklable ``fn(response, reference) -> float`` (run in workers);
    ``reward.plugins`` does the same from the config.
    """

    def __init__(self, cfg: RewardConfig | None = None, extra_scorers: Mapping[str, Callable] | None = None):
        self.cfg = cfg or RewardConfig()
        if self.cfg.workers < 1:
            raise ValueError(f"reward.workers: must be >= 1, got {self.cfg.workers}")
        for key in ("code_memory_mb", "code_tmpfs_mb", "code_nproc"):
            if getattr(self.cfg, key) < 1:
                raise ValueError(f"reward.{key}: must be >= 1, got {getattr(self.cfg, key)}")
        check_memory_fits(self.cfg)
        from megatron_rlvr.rewards.sandbox import sandbox_info

        log.info("%s", sandbox_info().describe(code_limits(self.cfg)))  # what a code item would get here
        self._extra = dict(extra_scorers or {})
        self._table = VerifierTable(self.cfg, self._extra)  # the routing; in-process items are scored with it too
        self._warm: list[str] = []  # verifiers whose setup every worker has done (replacements do it at start)
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self.totals: Counter = Counter(dict.fromkeys(COUNTER_KEYS, 0))
        self.last_errors: list[str] = []  # the messages of the last batch's verifier errors (for logs)
        self._start_failures = 0
        for _ in range(self.cfg.workers):
            self._workers.append(self._start_worker())

    # --- lifecycle -------------------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.cfg, self._extra or None, tuple(self._warm)), daemon=True
        )
        process.start()
        child.close()
        return _Worker(process=process, conn=parent, started=time.monotonic())

    def _replace(self, index: int) -> None:
        old = self._workers[index]
        if old.process.is_alive():
            old.process.kill()
        old.process.join(timeout=5)
        old.conn.close()
        self._workers[index] = self._start_worker()

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_workers", None):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down what close() needs
                pass

    # --- scoring ---------------------------------------------------------------------------------------------

    def _item_timeout(self, task: str, reference: Any) -> float:
        if task == "code":
            runs = len(reference["io"]) if "io" in reference else 1
            return self.cfg.code_wall_s * runs + _CODE_SLACK_S
        return self.cfg.timeout_s

    def score_batch(
        self, tasks: Sequence[str], responses: Sequence[str], references: Sequence[Any]
    ) -> tuple[list[float], dict[str, int]]:
        """Rewards in input order and this batch's counters (items, timeouts, crashes, errors, verifier/<name>)."""
        if not self._workers:
            raise RuntimeError("RewardPool.score_batch: the pool is closed")
        if not len(tasks) == len(responses) == len(references):
            raise ValueError(
                f"RewardPool.score_batch: tasks, responses and references differ in length "
                f"({len(tasks)}, {len(responses)}, {len(references)})"
            )
        routes = []
        for i, (task, reference) in enumerate(zip(tasks, references)):
            try:
                routes.append(self._table.route(task, reference))
            except ValueError as exc:
                raise ValueError(f"RewardPool.score_batch: item {i}: {exc}") from None
        rewards = [0.0] * len(tasks)
        counters = Counter(dict.fromkeys(COUNTER_KEYS, 0))
        counters["items"] = len(tasks)
        counters.update(f"verifier/{route}" for route in routes)
        self.last_errors = []
        pending: deque[int] = deque()
        for i, route in enumerate(routes):
            response = responses[i] if isinstance(responses[i], str) else ""
            if self._table.in_process(route):
                try:
                    rewards[i] = self._table.score(route, tasks[i], response, references[i])
                except Exception as exc:  # noqa: BLE001
                    counters["errors"] += 1
                    self.last_errors.append(f"item {i}: {type(exc).__name__}: {exc}"[:500])
            else:
                pending.append(i)
        self._warm_up({routes[i] for i in pending})
        self._run_remote(pending, routes, tasks, responses, references, rewards, counters)
        if self.last_errors:
            log.warning(
                "reward: %d verifier errors in a batch of %d (each scored 0); first: %s",
                len(self.last_errors),
                len(tasks),
                "; ".join(self.last_errors[:3]),
            )
        self.totals.update(counters)
        return rewards, dict(counters)

    def _warm_up(self, routes: set[str]) -> None:
        """Ask every worker to do the one-time setup of verifiers not seen before (VerifierTable.warm)."""
        for route in sorted(routes - set(self._warm)):
            if reasoning_gym.dataset_name(route) is None:
                continue  # nothing slow to do first
            self._warm.append(route)  # workers started from now on do it before they announce readiness
            for worker in self._workers:
                worker.conn.send(("warm", route))
                worker.warming += 1
                worker.started = time.monotonic()

    def _run_remote(self, pending, routes, tasks, responses, references, rewards, counters) -> None:
        outstanding = len(pending)
        while outstanding:
            now = time.monotonic()
            for worker in self._workers:
                if worker.ready and not worker.warming and worker.item is None and pending:
                    i = pending.popleft()
                    response = responses[i] if isinstance(responses[i], str) else ""
                    worker.item = i
                    worker.deadline = now + self._item_timeout(tasks[i], references[i])
                    worker.conn.send((i, routes[i], tasks[i], response, references[i]))
            busy = [w for w in self._workers if w.item is not None]
            wait_s = max(0.0, min((w.deadline for w in busy), default=now + 1.0) - now)
            ready = set(wait([w.conn for w in self._workers], timeout=min(wait_s, 1.0)))
            for index, worker in enumerate(self._workers):
                if worker.conn in ready:
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        if worker.item is not None:
                            counters["crashes"] += 1
                            outstanding -= 1
                        elif not worker.ready or worker.warming:
                            self._note_start_failure(worker)
                        self._replace(index)
                        continue
                    if message[0] == "ready":
                        worker.ready = True
                        self._start_failures = 0
                        continue
                    if message[0] == "warmed":
                        worker.warming -= 1
                        if message[1] is not None:
                            log.warning("reward: a verifier's setup failed in a worker: %s", message[1])
                        continue
                    if message[0] == "setup_error":
                        self.close()
                        raise RuntimeError(f"RewardPool: a verifier worker could not load the verifiers: {message[1]}")
                    if message[0] == "refused":
                        self.close()
                        raise SandboxUnavailableError(message[2])
                    item_id, reward, error = message
                    if item_id == worker.item:
                        rewards[item_id] = reward
                        if error is not None:
                            counters["errors"] += 1
                            self.last_errors.append(f"item {item_id}: {error}")
                        worker.item = None
                        outstanding -= 1
                elif worker.item is not None and time.monotonic() >= worker.deadline:
                    counters["timeouts"] += 1
                    outstanding -= 1
                    self._replace(index)
                elif (not worker.ready or worker.warming) and (
                    not worker.process.is_alive() or time.monotonic() - worker.started > _START_TIMEOUT_S
                ):
                    self._note_start_failure(worker)  # died or hung while starting (e.g. the import failed)
                    self._replace(index)

    def _note_start_failure(self, worker: _Worker) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            code = worker.process.exitcode
            self.close()
            raise RuntimeError(
                f"RewardPool: {self._start_failures} verifier workers in a row died while starting (last exit code "
                f"{code} or none: hung); check that math-verify imports and that the main module is guarded by "
                f"`if __name__ == '__main__':` (workers are spawned)"
            )
