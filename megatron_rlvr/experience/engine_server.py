"""The engine ranks' loop (``rollout.placement: separate``): serve the actor's commands until it says stop.

An engine rank never builds Megatron. It holds a vLLM engine, a verifier pool and its own copy of the prompt stream,
and per command (wire.py describes the protocol):
- "weights": receive the actor's weights over the cross group (rollout/transfer.py) and load them; the version
  number travels with them. Only ever between generations.
- "collect": one whole step of experience (`collect.collect`: generate, score, dynamic-sampling refill) from the
  prompt-stream state the command carries; engine rank 0 replies with it, the stream's state after the draws and
  the weight version that sampled it. The engine ranks split the prompts as the colocated ranks do (rollout DP).
- "generate": the actor ranks' requests (validation, PBA's base evidence), each with its own sampling, answered in
  order by the target model alone: outer prefixes are for training samples only.
A failure is replied as a `Failure` naming this rank (a failed weight load, at the next request that has a reply),
and the rank then exits. An actor that dies or goes silent makes the next cross-group call raise here: the rank
exits too, so nothing waits on a dead peer.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch.distributed as dist

from megatron_rlvr.config import Config
from megatron_rlvr.experience.collect import collect
from megatron_rlvr.experience.construction import make_rollout_engine, prompt_stream
from megatron_rlvr.experience.wire import Failure, Rollout
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout.prefixes import without_prefixes
from megatron_rlvr.rollout.transfer import WeightReceiver, load_weights
from megatron_rlvr.runtime.roles import Roles, broadcast_object, send_object


def serve(cfg: Config, roles: Roles) -> None:
    """Run this engine rank until the actor's "stop" (returns) or a failure (raises). ``rollout.max_staleness >= 2``:
    the engines stream instead (stream_server.py)."""
    if cfg.rollout.max_staleness >= 2:
        from megatron_rlvr.experience.stream_server import serve_stream

        serve_stream(cfg, roles)
        return
    stream = prompt_stream(cfg)
    loader, pad_id = stream.loader, stream.pad_id
    rank, tp = dist.get_rank(), cfg.rollout.tp
    engine = make_rollout_engine(cfg, rank)
    # whole tensors: the engine checks each one whole and keeps only its engine-TP shard (shard_stage.py, "full")
    receiver = WeightReceiver(roles.cross, engine_tp=tp, engine_tp_rank=rank % tp, dims=None, shard=False)
    version: int | None = None
    failure: Failure | None = None
    group = roles.cross_objects
    with RewardPool(cfg.reward) as pool, contextlib.closing(engine):
        while True:
            command = broadcast_object(group, None, root=0)
            reply: Any = None
            if command.kind == "stop":
                return
            try:
                if failure is not None:
                    raise RuntimeError(failure.what)
                if command.kind == "weights":
                    version = load_weights(engine, receiver)
                    continue
                if version is None:
                    raise RuntimeError(f"{command.kind!r} before any weights arrived")
                if command.kind == "collect":
                    started = time.perf_counter()
                    loader.load_state_dict(command.loader)
                    exp = collect(
                        engine, pool, loader, cfg, pad_id=pad_id, run_seed=cfg.trainer.seed, step=command.step
                    )
                    reply = Rollout(command.step, version, loader.state_dict(), exp, time.perf_counter() - started)
                elif command.kind == "generate":
                    reply = answer(engine, command.requests, tp)
                else:
                    raise RuntimeError(f"unknown command {command.kind!r}")
            except Exception as e:  # noqa: BLE001 - reported to the actor, then this rank exits
                failure = failure or Failure(roles.global_rank, f"{command.kind}: {type(e).__name__}: {e}")
                print(f"[engine rank {roles.global_rank}] {failure.what}", file=sys.stderr, flush=True)
                if command.kind == "weights":
                    continue  # the actor learns it with the reply to its next request
                reply = failure
            if rank == 0:
                send_object(group, reply, 0)
            if isinstance(reply, Failure):
                raise RuntimeError(f"engine rank {roles.global_rank} stopped: {reply.what}")


def answer(engine, requests: list[Any], tp: int) -> list[Any]:
    """The actor's requests (prompt ids, n, sampling), each answered in order by the target model (never with outer
    prefixes: validation and base evidence measure the model itself); the engine ranks' rollout-DP groups share
    them."""
    engine = without_prefixes(engine)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    dp, dp_rank = world // tp, rank // tp
    mine = [
        (i, engine.generate(prompts, n, sampling) if prompts else [])
        for i, (prompts, n, sampling) in enumerate(requests)
        if i % dp == dp_rank
    ]
    shares: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(shares, mine if rank % tp == 0 else [])
    else:
        shares = [mine]
    answers: list[Any] = [None] * len(requests)
    for share in shares:
        for i, out in share:
            answers[i] = out
    return answers
