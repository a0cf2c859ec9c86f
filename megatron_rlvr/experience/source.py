"""The one source of experience the trainer reads, step by step (`ExperienceSource`): it either generates in place
(colocated.py) or hands over what the engine ranks produced (engine_ranks.py); docs/separate-placement.md describes
both. `make_source` picks one for ``rollout.placement``.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.collect import Experience, collect
from megatron_rlvr.experience.colocated import CollectStep, ColocatedSource
from megatron_rlvr.experience.construction import EngineFactory, make_rollout_engine
from megatron_rlvr.experience.engine_ranks import EngineRanksSource
from megatron_rlvr.experience.stream import StreamState
from megatron_rlvr.experience.wire import Rollout
from megatron_rlvr.protocols.actor import Actor
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import RolloutEngine
from megatron_rlvr.runtime.roles import Roles


class ExperienceSource(Protocol):
    """What the loop reads experience from. Every method is a collective over the actor ranks."""

    engine: RolloutEngine  # samples the target model on the actor's behalf (validation, PBA's base evidence)

    def next(self, step: int) -> tuple[Experience, dict[str, float]]:
        """Step ``step``'s experience and the source's metrics for it."""

    def after_update(self, step: int) -> dict[str, float]:
        """The actor finished update ``step``: bring the engines its weights when they sample next."""

    def validate(self, step: int, val_items: list[PromptItem], pad_id: int) -> tuple[dict[str, float], np.ndarray]:
        """val/* metrics and the per-token entropy of the answers to ``val_items`` with the current weights."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume the stream exactly (the prompt loader's position)."""

    def pending(self) -> Rollout | StreamState | None:
        """What the next checkpoint stores beside the weights: a rollout sampled ahead (one-step-off), or the
        stream's state (fully asynchronous: finished groups, responses in flight)."""

    def close(self) -> None:
        """Release the engines (not after an error: a rank that raised alone must exit, not wait here)."""


def make_source(
    cfg: Config,
    roles: Roles | None,
    actor: Actor,
    pool: RewardPool,
    loader: PromptLoader,
    pad_id: int,
    *,
    start_step: int,
    pending: Rollout | StreamState | None = None,
    make_engine: EngineFactory = make_rollout_engine,
    collect_step: CollectStep = collect,
) -> ExperienceSource:
    """The run's experience source for ``rollout.placement``. ``make_engine`` and ``collect_step`` are the colocated
    source's (the engine ranks build their engines and collect where they run)."""
    if cfg.rollout.placement == "separate":
        if make_engine is not make_rollout_engine or collect_step is not collect:
            raise ConfigError(
                "rollout.placement=separate: the engine ranks build their engines and collect where they run, so a "
                "replaced engine or collection step (trainer.Parts engine, collect) would be ignored; expected the "
                "defaults, or rollout.placement=colocated"
            )
        return EngineRanksSource(cfg, roles, actor, pool, loader, pad_id, start_step=start_step, pending=pending)
    return ColocatedSource(cfg, actor, pool, loader, pad_id, make_engine=make_engine, collect_step=collect_step)
