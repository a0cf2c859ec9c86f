"""Separate placement, the actor's side (``rollout.placement: separate``): the engine ranks (engine_server.py)
generate, score and refill whole steps from their own copy of the prompt stream; actor rank 0 commands them over the
cross group (wire.py), sends the weights (rollout/transfer.py) and receives each step's experience, which it hands to
the other actor ranks. With ``rollout.max_staleness: 1`` the engines sample step t+1 with the weights the update t
starts from, while the actor runs update t: one update stale, logged as ``rollout/staleness``. With
``rollout.max_staleness >= 2`` the engines stream (stream_server.py, docs/async.md): each step "takes" what the
admission ledger selects, and the weights of every update go in while responses are in flight; the weights of step
s + 1 carry its "take", so its experience is on its way while the actor logs step s.

Exact resume: a step's rollout is a function of the run seed, the step, the prompt stream's state and the weight
version that samples it. With max_staleness 0 that version is the checkpoint's own weights, so a resumed run
regenerates the step. With 1, the step after a checkpoint was sampled by the weights before the last update, which
the checkpoint no longer holds: that rollout is received before the checkpoint is written and stored with it
(`pending`), and a resumed run trains on it. Streamed, a checkpoint stores the stream's state instead (finished
groups, every response in flight and the next step's experience when it had shipped, `stream.StreamState`), which a
resumed run continues; timing decides which version samples which token there, so a resumed run is not the
uninterrupted one (docs/async.md says what holds).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch.distributed as dist

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.experience.collect import Experience
from megatron_rlvr.experience.validation import validate
from megatron_rlvr.experience.wire import Command, EngineRankError, Failure, Rollout
from megatron_rlvr.protocols.actor import Actor
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.runtime.roles import ROLE_TIMEOUT_S, Roles, broadcast_object, recv_object


class EngineRanksSource:
    """Actor side of separate placement (see the module doc). A collective over the actor ranks at every call."""

    def __init__(
        self,
        cfg: Config,
        roles: Roles,
        actor: Actor,
        pool: RewardPool,
        loader: PromptLoader,
        pad_id: int,
        *,
        start_step: int,
        pending: Any = None,
    ) -> None:
        self.cfg, self.roles, self.actor, self.pool, self.loader = cfg, roles, actor, pool, loader
        self.off_policy = cfg.rollout.max_staleness == 1
        self.streaming = cfg.rollout.max_staleness >= 2
        self.group = roles.cross_objects  # None on actor ranks other than 0
        self.sender = None
        if roles.cross is not None:
            from megatron_rlvr.rollout.transfer import WeightSender

            self.sender = WeightSender(roles.cross, timeout_s=ROLE_TIMEOUT_S)
        self.engine_version: int | None = None  # the weight version the engines hold
        self.inflight: int | None = None  # the step whose experience is on its way (asked for, not received)
        self.prefetched: Rollout | None = pending.taken if self.streaming and pending is not None else pending
        self.snapshot = pending if self.streaming else None  # streamed: the stream's state for the next checkpoint
        self.transfer: dict[str, float] = {}
        self.engine = RemoteEngine(self)  # validation samples through it (validation.validate)
        self._ensure_weights(start_step)
        if self.streaming:  # from here on the engines admit prompts and generate without pause
            state = None if pending is None else dataclasses.replace(pending, taken=None)
            self._command(Command("start", step=start_step, loader=self.loader.state_dict(), state=state))
        self.stepped = time.perf_counter()  # when the last experience was handed over

    # -- the trainer's interface

    def next(self, step: int) -> tuple[Experience, dict[str, float]]:
        if self.streaming:
            return self._take(step)
        self._drain()
        rollout, self.prefetched = self.prefetched, None
        if rollout is None:
            self._ensure_weights(step)
            self._command(Command("collect", step=step, loader=self.loader.state_dict()))
            rollout = self._receive()
        if rollout.step != step:
            raise EngineRankError(f"the engine ranks sent step {rollout.step}'s experience for step {step}")
        self.loader.load_state_dict(rollout.loader_after)
        # staleness: updates between the weights that sampled and those the update starts from
        metrics = {"rollout/staleness": float(step - rollout.version), "rollout/engine_seconds": rollout.seconds}
        if self.off_policy and step + 1 < self.cfg.trainer.steps:
            # step + 1 samples with the weights update `step` starts from, while the actor runs that update
            self._ensure_weights(step)
            self._command(Command("collect", step=step + 1, loader=self.loader.state_dict()))
            self.inflight = step + 1
        metrics |= self.take_transfer_metrics()
        return rollout.experience, metrics

    def _take(self, step: int) -> tuple[Experience, dict[str, float]]:
        """Streamed: step ``step``'s groups as the engines' admission ledger selects them (they go on generating)."""
        started = time.perf_counter()
        self._drain()  # asked for with the weights of this step (after_update), or taken before a checkpoint
        rollout, self.prefetched = self.prefetched, None
        if rollout is None:
            self._command(Command("take", step=step))
            rollout = self._receive()
        if rollout.step != step:
            raise EngineRankError(f"the engine ranks sent step {rollout.step}'s experience for step {step}")
        self.loader.load_state_dict(rollout.loader_after)
        now = time.perf_counter()
        metrics = {
            "rollout/engine_seconds": rollout.seconds,
            # the actor's wait for this step's experience over the whole cycle since the last one was handed over
            "async/trainer_idle_frac": (now - started) / max(now - self.stepped, 1e-9),
        }
        self.stepped = now
        return rollout.experience, metrics | self.take_transfer_metrics()

    def after_update(self, step: int) -> dict[str, float]:
        # the next step samples with the weights just trained; streamed, they go in while responses are in flight
        # and ask for that step's experience
        if not self.off_policy and step + 1 < self.cfg.trainer.steps:
            self._ensure_weights(step + 1, take=self.streaming)
        return self.take_transfer_metrics()

    def validate(self, step: int, val_items: list[PromptItem], pad_id: int) -> tuple[dict[str, float], np.ndarray]:
        self._drain()
        self._ensure_weights(step)
        return validate(self.engine, self.pool, self.actor, val_items, self.cfg, pad_id)

    def state_dict(self) -> dict[str, Any]:
        if self.streaming:  # the stream's state: finished groups and every response in flight (docs/async.md)
            self._drain()  # the next step's experience, if asked for, left the ledger: the checkpoint keeps it
            self._command(Command("snapshot"))
            self.snapshot = dataclasses.replace(self._receive(), taken=self.prefetched)
            return {"loader": self.snapshot.loader}
        self._drain()  # a checkpoint holds the rollout the engines sampled with weights it no longer has
        return {"loader": self.loader.state_dict()}

    def pending(self) -> Any:
        return self.snapshot if self.streaming else self.prefetched

    def close(self) -> None:
        """Tell the engine ranks to stop (they exit their loop); the reply of an outstanding request is dropped."""
        try:
            self._drain()
            self._command(Command("stop"))
        except EngineRankError:
            pass

    # -- the protocol

    def _first(self, fn, what: str):
        """``fn()`` on actor rank 0; its result, or its failure, on every actor rank."""
        result: Any = None
        if dist.get_rank() == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - a dead peer surfaces as gloo's RuntimeError
                result = Failure(-1, f"{what}: {type(e).__name__}: {e}")
        if dist.get_world_size() > 1:
            box = [result]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        if isinstance(result, Failure):
            who = "the exchange with the engine ranks" if result.rank < 0 else f"engine rank {result.rank}"
            raise EngineRankError(
                f"{who} failed ({result.what}); the run stops (rerun to resume from the last checkpoint)"
            )
        return result

    def _command(self, command: Command) -> None:
        self._first(lambda: broadcast_object(self.group, command, root=0), f"sending {command.kind!r}")

    def _receive(self):
        return self._first(lambda: recv_object(self.group, 1), "waiting for the engine ranks' reply")

    def _drain(self) -> None:
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self.prefetched = self._receive()
            if self.prefetched.step != step:
                raise EngineRankError(f"the engine ranks sent step {self.prefetched.step} for step {step}")

    def _ensure_weights(self, version: int, take: bool = False) -> None:
        """The engines hold the actor's current weights (version ``version``) afterwards; a collective over the
        actor ranks (every rank joins the export). Streamed, ``take`` asks for step ``version``'s experience too."""
        if self.engine_version == version:
            return
        self._drain()
        self._command(Command("weights", version=version, take=take))
        buckets = self.actor.engine_weights(self.cfg.rollout.bucket_bytes, lend=True)
        if self.sender is not None:

            def send():
                try:
                    return self.sender.send(buckets, version)
                except Exception:
                    for _ in buckets:  # the other actor ranks finish the export collective: join it to the end
                        pass
                    raise

            stats = self._first(send, "sending the weights")
        else:
            for _ in buckets:  # the export is a collective over the actor's model-parallel group
                pass
            stats = self._first(lambda: None, "sending the weights")
        self.engine_version = version
        if take:
            self.inflight = version
        for key, value in (stats or {}).items():
            self.transfer[key] = self.transfer.get(key, 0.0) + float(value)

    def take_transfer_metrics(self) -> dict[str, float]:
        taken, self.transfer = self.transfer, {}
        return taken

    def generate_remote(self, requests: list[Any]) -> list[Any]:
        """Every actor rank's (prompt ids, n, sampling) request answered by the engine ranks, in order."""
        self._drain()
        self._command(Command("generate", requests=requests))
        return self._receive()


class RemoteEngine:
    """The engine ranks behind the `RolloutEngine` protocol on the actor ranks, for validation (`generate` only):
    each actor rank's request, with its own sampling seed, is answered as that rank's own engine would. The engine
    ranks sample the target model itself (no outer prefixes): these requests are validation and PBA's base evidence.
    """

    ranks_per_engine = 1  # collect.generate: every actor rank asks on its own, whatever rollout.tp is

    def __init__(self, source: EngineRanksSource) -> None:
        self.source = source

    def generate(self, prompt_token_ids, n, sampling):
        mine = (list(map(list, prompt_token_ids)), n, sampling)
        requests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(requests, mine)
        return self.source.generate_remote(requests)[dist.get_rank()]

    def update_weights(self, weights, lent: bool = False) -> None:
        raise NotImplementedError("the engine ranks receive weights through EngineRanksSource")

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    @property
    def alive(self) -> bool:  # a dead engine rank surfaces as EngineRankError from the source instead
        return True

    def close(self) -> None:  # the engine ranks are stopped by EngineRanksSource.close
        pass
