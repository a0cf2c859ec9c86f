"""Colocated placement (``rollout.placement: colocated``): every rank samples with its own engine, then the engine
sleeps while the actor trains and the new weights are synced into it; they take turns. A dead engine is rebuilt and
the step retried once. How a rank's engine is built and how a step's experience is collected are given to the
source (`EngineFactory`, `CollectStep`): the real ones unless the loop is handed others (trainer.Parts)."""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import numpy as np

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.experience.collect import Experience, collect
from megatron_rlvr.experience.construction import EngineFactory, make_rollout_engine
from megatron_rlvr.experience.validation import validate
from megatron_rlvr.experience.wire import Rollout
from megatron_rlvr.protocols.actor import Actor, WeightSource
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import EngineDiedError, RolloutEngine
from megatron_rlvr.runtime import distributed


def sync_weights(actor: WeightSource, engine: RolloutEngine, bucket_bytes: int) -> None:
    """Stream the actor's weights (HF names) into this rank's engine; a collective over the model-parallel group.
    The buckets are lent (views of the exchange's shared memory where TP ranks share a host): the engine consumes
    each tensor before it draws the next bucket, so no rank allocates the model's size anew per sync."""
    engine.update_weights(itertools.chain.from_iterable(actor.engine_weights(bucket_bytes, lend=True)), lent=True)


class CollectStep(Protocol):
    """One step's experience from this rank's engine (`collect.collect`)."""

    def __call__(
        self,
        engine: RolloutEngine,
        pool: RewardPool,
        loader: PromptLoader,
        cfg: Config,
        *,
        pad_id: int,
        run_seed: int,
        step: int,
    ) -> Experience: ...


def build_engine(cfg: Config, actor: WeightSource, make_engine: EngineFactory = make_rollout_engine) -> RolloutEngine:
    """This rank's engine, with the actor's current weights."""
    engine = make_engine(cfg, distributed.rank())
    sync_weights(actor, engine, cfg.rollout.bucket_bytes)
    return engine


def revive_engine(
    cfg: Config, actor: WeightSource, engine: RolloutEngine, make_engine: EngineFactory = make_rollout_engine
) -> RolloutEngine:
    """After an engine died somewhere (every rank learns it together): dead engines are rebuilt, live ones re-synced,
    since the weight export is a collective every rank joins. The actor's state is untouched."""
    if engine.alive:
        sync_weights(actor, engine, cfg.rollout.bucket_bytes)
        return engine
    return build_engine(cfg, actor, make_engine)


class ColocatedSource:
    """Every rank samples with its own engine and trains; they take turns."""

    def __init__(
        self,
        cfg: Config,
        actor: Actor,
        pool: RewardPool,
        loader: PromptLoader,
        pad_id: int,
        *,
        make_engine: EngineFactory = make_rollout_engine,
        collect_step: CollectStep = collect,
    ) -> None:
        self.cfg, self.actor, self.pool, self.loader, self.pad_id = cfg, actor, pool, loader, pad_id
        self.make_engine, self.collect_step = make_engine, collect_step
        self.engine = build_engine(cfg, actor, make_engine)

    def next(self, step: int) -> tuple[Experience, dict[str, float]]:
        drawn_from = self.loader.state_dict()  # a retried step draws the same prompts again
        for attempt in range(2):
            try:
                exp = self.collect_step(
                    self.engine,
                    self.pool,
                    self.loader,
                    self.cfg,
                    pad_id=self.pad_id,
                    run_seed=self.cfg.trainer.seed,
                    step=step,
                )
                break
            except EngineDiedError:  # raised on every rank together: revive the engines, retry once
                if attempt:
                    raise
                self.engine = revive_engine(self.cfg, self.actor, self.engine, self.make_engine)
                self.loader.load_state_dict(drawn_from)
        self.engine.sleep()  # a colocated GPU engine hands its KV cache (level 2: weights too) to the update
        return exp, {}

    def after_update(self, step: int) -> dict[str, float]:
        sync_weights(self.actor, self.engine, self.cfg.rollout.bucket_bytes)
        return {}

    def validate(self, step: int, val_items: list[PromptItem], pad_id: int) -> tuple[dict[str, float], np.ndarray]:
        metrics, entropy = validate(self.engine, self.pool, self.actor, val_items, self.cfg, pad_id)
        self.engine.sleep()
        return metrics, entropy

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def pending(self) -> Rollout | None:
        return None

    def close(self) -> None:
        self.engine.close()  # now, not from __del__ at interpreter exit, when vLLM's shutdown finds its modules gone
