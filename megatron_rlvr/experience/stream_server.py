"""The engine ranks' loop under fully asynchronous training (``rollout.max_staleness >= 2``, docs/async.md): the
transport around `stream.StreamCore`.

The engine ranks generate continuously and listen for the actor's commands between engine steps (wire.py;
`roles.ObjectListener` polls the command broadcast without waiting):
- "weights": receive the actor's weights (rollout/transfer.py) between two engine steps and load them while responses
  are in flight; with ``rollout.recompute_kv_after_sync`` their KV cache is then recomputed with the new weights.
  With ``take``, it is also the "take" of the step these weights train: the actor asks for the next step's
  experience as it sends the weights, so the reply leaves as soon as the step is ready instead of one engine step
  after a separate command (the step a command waits for can be long: the engine runs every response in flight);
- "start": the prompt stream's state (and a checkpoint's `StreamState`) to stream from; before it nothing is admitted;
- "take": reply with step s's experience as soon as the admission ledger selects it (the engines go on meanwhile);
- "generate": the actor's own requests (validation, PBA's base evidence), answered by the stream;
- "snapshot": reply with the stream's `StreamState` for a checkpoint (nothing pauses);
- "stop": leave.

Every engine rank runs the same ticks: poll the command, step its engine, then exchange what happened (groups done,
busy time, whether the command arrived) with the other engine ranks (one all-gather; none with one rank), apply it
to the replicated ledger, act on a command that every rank has, ship a step that is ready, admit. With nothing
running anywhere and nothing admissible, the ranks wait for the next command instead of spinning.

A failure is reported like engine_server.py's: the reply to the actor's next request is a `Failure` naming the rank.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch.distributed as dist

from megatron_rlvr.config import Config
from megatron_rlvr.experience.construction import make_rollout_engine, prompt_stream
from megatron_rlvr.experience.stream import StreamCore
from megatron_rlvr.experience.wire import Command, Failure
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout.transfer import WeightReceiver, load_weights
from megatron_rlvr.runtime.roles import ObjectListener, Roles, send_object

_SPIN_S = 0.002  # a rank whose replica has nothing to run while others do waits this long per tick


def serve_stream(cfg: Config, roles: Roles) -> None:
    """Run this engine rank until the actor's "stop" (returns) or a failure (raises)."""
    prompts = prompt_stream(cfg)
    rank, tp = dist.get_rank(), cfg.rollout.tp
    engine = make_rollout_engine(cfg, rank)
    receiver = WeightReceiver(roles.cross, engine_tp=tp, engine_tp_rank=rank % tp, dims=None, shard=False)
    listener = ObjectListener(roles.cross_objects)
    server = _Server(cfg, roles, engine, receiver, listener, prompts.loader, prompts.pad_id)
    with RewardPool(cfg.reward) as pool, contextlib.closing(engine):
        server.pool = pool
        try:
            server.run()
        except Exception as e:  # noqa: BLE001 - reported to the actor, then this rank exits
            failure = Failure(roles.global_rank, f"{type(e).__name__}: {e}")
            print(f"[engine rank {roles.global_rank}] {failure.what}", file=sys.stderr, flush=True)
            if rank == 0:
                server.fail(failure)
            raise RuntimeError(f"engine rank {roles.global_rank} stopped: {failure.what}") from e


class _Server:
    def __init__(self, cfg, roles, engine, receiver, listener, loader, pad_id) -> None:
        self.cfg, self.roles, self.engine, self.receiver, self.listener = cfg, roles, engine, receiver, listener
        self.loader, self.pad_id = loader, pad_id
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.replicas, self.replica = self.world // cfg.rollout.tp, self.rank // cfg.rollout.tp
        self.group = roles.cross_objects
        self.pool: RewardPool | None = None
        self.version: int | None = None
        self.core: StreamCore | None = None
        self.take: int | None = None  # the step the actor waits for
        self.awaiting_reply = False

    def reply(self, obj: Any) -> None:
        if self.rank == 0:
            send_object(self.group, obj, 0)
        self.awaiting_reply = False

    def run(self) -> None:
        while self.core is None:  # before "start" nothing streams: serve commands as they come
            if not self.handle(self.listener.take()):
                return
        core = self.core
        while True:
            report = (self.listener.arrived(), core.events())
            reports = [report] if self.world == 1 else _all_gather(report)
            core.apply([events for _, events in reports])
            if all(arrived for arrived, _ in reports) and not self.handle(self.listener.take()):
                return
            if self.take is not None:
                rollout = core.ship(self.take)
                if core.ledger.next_step > self.take:  # shipped (the shipper built it; the others only agree)
                    self.take = None
                    self.reply(rollout)
            core.admit()
            if core.advance():
                continue
            if core.idle():
                if self.take is not None:
                    raise RuntimeError(f"step {self.take}: nothing runs and nothing may start, yet it is not ready")
                self.listener.wait()  # nothing can change until a command comes
            elif self.world > 1:
                time.sleep(_SPIN_S)

    def handle(self, command: Command) -> bool:
        """Act on one command (every engine rank alike); False on "stop"."""
        kind = command.kind
        if kind == "stop":
            return False
        if kind == "weights":
            self.version = load_weights(self.engine, self.receiver)
            if self.core is not None:
                if self.cfg.rollout.recompute_kv_after_sync:
                    self.core.stream.refresh_kv()
                self.core.version = self.version
                if command.take:
                    self.awaiting_reply, self.take = True, command.version
            return True
        if self.version is None:
            raise RuntimeError(f"{kind!r} before any weights arrived")
        if kind == "start":
            self.loader.load_state_dict(command.loader)
            self.core = StreamCore(
                self.engine.stream(),
                self.pool,
                self.loader,
                self.cfg,
                pad_id=self.pad_id,
                replica=self.replica,
                replicas=self.replicas,
                shipper=self.rank == 0,
                start_step=command.step,
                version=self.version,
            )
            if command.state is not None:
                self.core.restore(command.state)
        elif kind == "take":
            self.awaiting_reply, self.take = True, command.step
        elif kind == "generate":
            self.awaiting_reply = True
            answers = self.core.answer(command.requests, self.replica)
            shares = (
                [answers] if self.world == 1 else _all_gather(answers if self.rank % self.cfg.rollout.tp == 0 else [])
            )
            out: list[Any] = [None] * len(command.requests)
            for share in shares:
                for i, completions in share:
                    out[i] = completions
            self.reply(out)
        elif kind == "snapshot":
            self.awaiting_reply = True
            local = self.core.local_state()
            shares = [local] if self.world == 1 else _all_gather(local)
            self.reply(self.core.state([flight for share in shares for flight in share]))
        else:
            raise RuntimeError(f"unknown command {kind!r}")
        return True

    def fail(self, failure: Failure) -> None:
        """Engine rank 0 after a failure: the actor's pending or next request is answered with ``failure``; weight
        transfers are read to their end meanwhile (the sender waits for every engine rank)."""
        try:
            if self.awaiting_reply:
                send_object(self.group, failure, 0)
                return
            while (command := self.listener.take()).kind not in ("stop", "take", "generate", "snapshot", "start"):
                if command.kind == "weights":
                    with contextlib.suppress(Exception):
                        _, stream = self.receiver.receive()
                        for _ in stream:
                            pass
                    if command.take:  # the actor waits for a reply to it
                        break
            if command.kind != "stop":
                send_object(self.group, failure, 0)
        except Exception:  # noqa: BLE001 - the actor is gone too: nothing left to tell
            pass


def _all_gather(obj: Any) -> list[Any]:
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, obj)
    return shares
