"""Fakes for the training loop's replaceable parts (`megatron_rlvr.trainer.Parts`): a test passes them to
``trainer.train(cfg, Parts(...))`` instead of assigning a module's global. Each wraps the real component and changes
or records one thing:

- rewards: `scripted_rewards` (a rule of the response's text, in place of the verifiers);
- engines: `RecordingEngine`, `ShiftedLogprobsEngine` (a wrapper that delegates the rest of `RolloutEngine`);
- the actor: `recording_actor`, `nonfinite_actor` (the real actor's class with `update` extended);
- a step's collection: `engine_closed_before`, `signalled_during`;
- checkpoints: `FailingShardWriter` (the disk full on one save).

Everything here runs inside the ranks (a worker group's function builds the `Parts`): megatron-core and vLLM are
imported when a part is first called, not with this module.
"""

from __future__ import annotations

import errno
import os
import signal
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptLoader
from megatron_rlvr.experience.collect import Experience
from megatron_rlvr.experience.collect import collect as real_collect
from megatron_rlvr.experience.colocated import CollectStep
from megatron_rlvr.experience.construction import EngineFactory, make_rollout_engine
from megatron_rlvr.protocols import Rollouts, Statistics, Targets
from megatron_rlvr.protocols.actor import Actor
from megatron_rlvr.rewards import RewardConfig, RewardPool
from megatron_rlvr.rollout import Completion, RolloutEngine, Sampling
from megatron_rlvr.runtime import distributed
from megatron_rlvr.trainer import megatron_actor

# ---------------------------------------------------------------------------------------------------------------
# Rewards


def one_in(n: int) -> Callable[[str], float]:
    """A scripted verifier's rule: 1 for about one response in ``n``, decided by a hash of its text (a random tiny
    model earns no real reward). Deterministic: the same response always gets the same reward."""
    return lambda text: float(zlib.crc32(text.encode()) % n == 0)


class ScriptedRewards(RewardPool):
    """A reward pool whose every score is ``rule(response text)``: the verifiers of the run's tasks are not asked.
    Its worker processes start as the real pool's do, so a run's processes are the same."""

    def __init__(self, cfg: RewardConfig, rule: Callable[[str], float]) -> None:
        super().__init__(cfg)
        self.rule = rule

    def score_batch(
        self, tasks: Sequence[str], responses: Sequence[str], references: Sequence[Any]
    ) -> tuple[list[float], dict[str, int]]:
        return [self.rule(r if isinstance(r, str) else "") for r in responses], {"items": len(responses)}


def scripted_rewards(rule: Callable[[str], float]) -> Callable[[RewardConfig], RewardPool]:
    """`Parts.rewards`: every response of the run (samples, anchors, validation) scored by ``rule``."""
    return lambda cfg: ScriptedRewards(cfg, rule)


# ---------------------------------------------------------------------------------------------------------------
# Engines


class WrappedEngine:
    """A `RolloutEngine` that delegates every call to ``inner``; subclasses change one."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner

    @property
    def ranks_per_engine(self) -> int | None:
        return self.inner.ranks_per_engine

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        return self.inner.generate(prompt_token_ids, n, sampling)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        self.inner.update_weights(weights, lent)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def close(self) -> None:
        self.inner.close()


class RecordingEngine(WrappedEngine):
    """Appends the name of every `generate`, `sleep` and `update_weights` call to ``calls``."""

    def __init__(self, inner: RolloutEngine, calls: list[str]) -> None:
        super().__init__(inner)
        self.calls = calls

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        self.calls.append("generate")
        return super().generate(prompt_token_ids, n, sampling)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        self.calls.append("update_weights")
        super().update_weights(weights, lent)

    def sleep(self) -> None:
        self.calls.append("sleep")
        super().sleep()


class ShiftedLogprobsEngine(WrappedEngine):
    """Reports every sampled token's log-prob lowered by ``shift``: the ratio to the actor is e^shift on every token."""

    def __init__(self, inner: RolloutEngine, shift: float) -> None:
        super().__init__(inner)
        self.shift = shift

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        groups = super().generate(prompt_token_ids, n, sampling)
        for group in groups:
            for c in group:
                c.logprobs = [lp - self.shift for lp in c.logprobs]
        return groups


def wrapped_engines(wrap: Callable[[RolloutEngine], RolloutEngine]) -> EngineFactory:
    """`Parts.engine`: each rank's real engine, wrapped (e.g. ``lambda e: RecordingEngine(e, calls)``)."""
    return lambda cfg, rank: wrap(make_rollout_engine(cfg, rank))


# ---------------------------------------------------------------------------------------------------------------
# The actor


def recording_actor(calls: list[str]) -> Callable[[Config], Actor]:
    """`Parts.actor`: the real actor, appending "update" to ``calls`` at every update."""

    def build(cfg: Config) -> Actor:
        from megatron_rlvr.actor.megatron_actor import MegatronActor

        class RecordingActor(MegatronActor):
            def update(
                self, rollouts: Rollouts, targets: Targets, statistics: Statistics, *, mini_batches: int
            ) -> dict[str, float]:
                calls.append("update")
                return super().update(rollouts, targets, statistics, mini_batches=mini_batches)

        return megatron_actor(cfg, RecordingActor)

    return build


def nonfinite_actor(seen: list[tuple[float, bool]]) -> Callable[[Config], Actor]:
    """`Parts.actor`: the real actor, given NaN advantages at every update (so every loss is NaN); appends to
    ``seen`` each update's ``actor/nonfinite`` and whether the weights came out of it untouched."""

    def build(cfg: Config) -> Actor:
        from megatron_rlvr.actor.megatron_actor import MegatronActor

        class NonFiniteActor(MegatronActor):
            def update(
                self, rollouts: Rollouts, targets: Targets, statistics: Statistics, *, mini_batches: int
            ) -> dict[str, float]:
                before = [p.detach().clone() for p in self.model_chunks[0].parameters()]
                nan = replace(targets, advantages=torch.full_like(targets.advantages, float("nan")))
                metrics = super().update(rollouts, nan, statistics, mini_batches=mini_batches)
                after = self.model_chunks[0].parameters()
                seen.append((metrics["actor/nonfinite"], all(torch.equal(a, b) for a, b in zip(before, after))))
                return metrics

        return megatron_actor(cfg, NonFiniteActor)

    return build


# ---------------------------------------------------------------------------------------------------------------
# A step's collection


def engine_closed_before(
    step: int, rank: int, steps_seen: list[int], collect: CollectStep = real_collect
) -> CollectStep:
    """`Parts.collect`: ``collect``, with ``rank``'s engine closed (dead) just before step ``step``'s first
    collection; every call's step is appended to ``steps_seen``."""

    def collect_step(
        engine: RolloutEngine, pool: RewardPool, loader: PromptLoader, cfg: Config, **at: int
    ) -> Experience:
        steps_seen.append(at["step"])
        if at["step"] == step and steps_seen.count(step) == 1 and distributed.rank() == rank:
            engine.close()
        return collect(engine, pool, loader, cfg, **at)

    return collect_step


def signalled_during(
    step: int, rank: int, collect: CollectStep = real_collect, signum: int = signal.SIGTERM
) -> CollectStep:
    """`Parts.collect`: ``collect``, with ``rank`` sent ``signum`` in the middle of step ``step`` (0-based: the
    step whose rollout runs then), as a scheduler's preemption notice arrives."""

    def collect_step(
        engine: RolloutEngine, pool: RewardPool, loader: PromptLoader, cfg: Config, **at: int
    ) -> Experience:
        if at["step"] == step and distributed.rank() == rank:
            os.kill(os.getpid(), signum)
        return collect(engine, pool, loader, cfg, **at)

    return collect_step


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


class FailingShardWriter:
    """A `ShardWriter` whose ``fail_at``-th write (1-based) leaves a partial file and fails with a full disk; the
    others are megatron-core's. ``dirs`` lists the directories it was asked to write."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.dirs: list[str] = []

    def __call__(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> None:
        from megatron_rlvr.checkpoint import write_shards

        self.dirs.append(checkpoint_dir)
        if len(self.dirs) == self.fail_at:
            (Path(checkpoint_dir) / "partial.distcp").write_bytes(b"\0" * 16)
            raise OSError(errno.ENOSPC, "No space left on device")
        write_shards(sharded_state_dict, checkpoint_dir)
