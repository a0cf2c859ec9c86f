"""Worker processes that host the environments of a batch of trajectories, with the reward pool's guarantees: no
call is waited for past its deadline, and no failure loses a trajectory silently.

Trajectory ``t`` lives in worker ``t % environment.workers`` for its whole life (its environment holds state). Each
worker runs one call at a time (a reset or one step of one trajectory); the clock of a call starts when it is handed
over. A call past ``environment.call_timeout_s`` has its worker SIGKILLed and replaced: that trajectory fails with
"timeout". A worker that dies mid-call (segfault, abort, OOM kill) is replaced: "crash". An exception in the
environment, or a step whose answer is not a `Step` of a str, a finite float and a bool, is "error". The other
trajectories the killed worker hosted lose their state with it: "lost". A failed trajectory ends with the return it
had; `Outcome.failure` says why and the episode counts it (``reward/env_<failure>`` in the metrics).

Workers are started with "spawn" (forking a trainer that holds threads is unsafe) and ignore SIGUSR1, like the
reward pool's.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_rlvr.environments.base import Environment, Step
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.rewards.config import RewardConfig

_START_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    """The answer to one call: reset's messages or a step's `Step`, or the failure that ended the trajectory."""

    value: Any = None
    failure: str = ""  # "", "timeout", "crash", "error" or "lost"
    message: str = ""


def _check_step(step: Any) -> Step:
    ok = isinstance(step, Step) and isinstance(step.observation, str) and isinstance(step.done, bool)
    if not ok or isinstance(step.reward, bool) or not isinstance(step.reward, int | float):
        raise TypeError(f"step returned {step!r:.120}; expected Step(observation: str, reward: float, done: bool)")
    if not math.isfinite(step.reward):
        raise ValueError(f"step returned the reward {step.reward}; expected a finite float")
    return Step(step.observation, float(step.reward), step.done)


def _worker_main(conn: Connection, cfg: EnvironmentConfig, reward: RewardConfig | None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from megatron_rlvr.environments.loading import environment_factory

    try:
        factory = environment_factory(cfg, reward)
    except Exception as exc:  # noqa: BLE001 - checked when the config loaded; a worker that differs says why
        conn.send(("setup_error", f"{type(exc).__name__}: {exc}"[:500]))
        return
    conn.send(("ready", None))
    envs: dict[int, Environment] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        op, tid, payload = message
        try:
            if op == "reset":
                env = factory()
                if not isinstance(env, Environment):
                    raise TypeError(f"{cfg.name} made a {type(env).__name__}, not an Environment (reset and step)")
                envs[tid] = env
                value: Any = [dict(m) for m in env.reset(payload)]
            elif op == "step":
                value = _check_step(envs[tid].step(payload))
                if value.done:
                    del envs[tid]
            else:  # "drop": the runner ended the trajectory (turn limit or token budget)
                envs.pop(tid, None)
                value = None
            conn.send((tid, value, ""))
        except Exception as exc:  # noqa: BLE001 - any environment failure ends its trajectory, never the run
            envs.pop(tid, None)
            conn.send((tid, None, f"{type(exc).__name__}: {exc}"[:500]))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    hosted: set[int]
    current: int | None = None
    deadline: float = 0.0


class EnvironmentHost:
    """The worker processes of one episode runner; `call` runs a batch of calls, one per trajectory."""

    def __init__(self, cfg: EnvironmentConfig, reward: RewardConfig | None = None):
        if cfg.name == "python_tool":  # every worker may run one tool program at its full budget at once
            from megatron_rlvr.environments.python_tool import check_memory_fits
            from megatron_rlvr.rewards.containment import check_run_containment

            check_memory_fits(cfg)
            check_run_containment(reward or RewardConfig(), [], cfg.name)  # isolated, or accepted without
        self.cfg, self.reward = cfg, reward
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * cfg.workers
        self._lost: set[int] = set()  # trajectories whose environment died with a killed worker

    def _start(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.cfg, self.reward), daemon=True)
        process.start()
        child.close()
        if not parent.poll(_START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"environment worker did not start within {_START_TIMEOUT_S:.0f} s")
        kind, detail = parent.recv()
        if kind != "ready":
            process.join(5)
            raise RuntimeError(f"environment worker could not load environment.name={self.cfg.name!r}: {detail}")
        worker = _Worker(process, parent, set())
        self._workers[index] = worker
        return worker

    def _worker(self, index: int) -> _Worker:
        worker = self._workers[index]
        return worker if worker is not None and worker.process.is_alive() else self._start(index)

    def _kill(self, index: int) -> set[int]:
        """Kill worker ``index``; the trajectories it hosted (their environments are gone)."""
        worker = self._workers[index]
        self._workers[index] = None
        if worker is None:
            return set()
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        return worker.hosted

    def call(self, calls: list[tuple[str, int, Any]]) -> list[Outcome]:
        """Run ``(op, trajectory, payload)`` calls (op: "reset", "step" or "drop"); one `Outcome` per call, in order."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        queues: list[deque[int]] = [deque() for _ in self._workers]
        for i, (_, tid, _) in enumerate(calls):
            if tid in self._lost:
                outcomes[i] = Outcome(failure="lost", message="its environment's worker was killed")
            else:
                queues[tid % len(self._workers)].append(i)
        busy: dict[int, int] = {}  # worker index -> the call it runs

        def hand_over(w: int) -> None:
            while queues[w]:
                i = queues[w].popleft()
                op, tid, payload = calls[i]
                if tid in self._lost:
                    outcomes[i] = Outcome(failure="lost", message="its environment's worker was killed")
                    continue
                worker = self._worker(w)
                worker.conn.send((op, tid, payload))
                worker.current, worker.deadline = i, time.monotonic() + self.cfg.call_timeout_s
                busy[w] = i
                return

        def fail(w: int, failure: str, message: str) -> None:
            i = busy.pop(w)
            outcomes[i] = Outcome(failure=failure, message=message)
            hosted = self._kill(w)
            self._lost |= hosted - {calls[i][1]}

        for w in range(len(self._workers)):
            if queues[w]:
                self._worker(w)  # every worker started before any clock does
        for w in range(len(self._workers)):
            hand_over(w)
        while busy:
            by_conn = {self._workers[w].conn: w for w in busy}
            timeout = max(0.0, min(self._workers[w].deadline for w in busy) - time.monotonic())
            for conn in wait(list(by_conn), timeout=timeout):  # answers first, then the deadlines
                w = by_conn[conn]
                try:
                    tid, value, error = conn.recv()
                except (EOFError, OSError):
                    fail(w, "crash", f"the environment worker died (exit code {self._workers[w].process.exitcode})")
                    hand_over(w)
                    continue
                i = busy.pop(w)
                op = calls[i][0]
                worker = self._workers[w]
                if error:
                    outcomes[i] = Outcome(failure="error", message=error)
                    worker.hosted.discard(tid)
                else:
                    outcomes[i] = Outcome(value=value)
                    if op == "reset":
                        worker.hosted.add(tid)
                    elif op == "drop" or value.done:
                        worker.hosted.discard(tid)
                hand_over(w)
            now = time.monotonic()
            for w in [w for w in busy if self._workers[w].deadline <= now]:
                fail(w, "timeout", f"no answer within environment.call_timeout_s={self.cfg.call_timeout_s}")
                self._worker(w)
                hand_over(w)
        return outcomes  # type: ignore[return-value]

    def forget(self) -> None:
        """A new batch of trajectories starts: ids may be reused."""
        self._lost.clear()

    def close(self) -> None:
        for index, worker in enumerate(self._workers):
            if worker is None:
                continue
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(2)
            self._kill(index)
