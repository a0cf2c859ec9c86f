"""Experience transforms: how an algorithm changes a step's experience without the loop knowing it.

An algorithm that adds, replaces or weighs the responses a step trains (ARMOR's anchors, SFT's demonstrations, PBA's
per-sequence KL coefficients) is an `ExperienceTransform`: ``before(step)`` runs before the step's experience is
drawn, ``__call__(step, experience)`` returns the transformed `Experience` (a new one: nothing is written into the
one it is given). The loop asks the registry for the run's transforms and applies them in order; it names none.

A transform registers itself in its own module, with the `experience_transform` decorator on its builder::

    @experience_transform("armor", enabled=lambda cfg: cfg.algo.armor.anchors, reserved_samples=1)
    def build(setup: TransformSetup) -> ExperienceTransform:
        return AnchorRollout(...)

- ``enabled(cfg)``: whether the run's config asks for it (its config section);
- ``reserved_samples``: samples of each group of ``rollout.group_size`` that the transform adds itself (ARMOR's
  anchor), so the experience source samples that many fewer per prompt (`source_config`);
- ``stage``: ``rollouts`` for transforms that change which responses train (they run first, in name order),
  ``targets`` for those that only weigh them (after);
- ``check(cfg)``: the method's own rules against the rest of the run's config (a one-line message, or None),
  checked when the run starts; two enabled transforms that both add samples are refused there too.

Modules in `megatron_rlvr.experience.methods` are found and imported when the registry is first read, so a new
method is one new module there (and its config section): no list to edit, nothing in the loop.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from megatron_rlvr.config import Config
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.collect import Experience

if TYPE_CHECKING:
    from megatron_rlvr.data import PromptItem, PromptLoader
    from megatron_rlvr.protocols.actor import Actor
    from megatron_rlvr.rewards import RewardPool
    from megatron_rlvr.rollout import RolloutEngine

METHODS = "megatron_rlvr.experience.methods"  # every module in this package registers its transforms
Stage = Literal["rollouts", "targets"]
STAGES: tuple[Stage, ...] = ("rollouts", "targets")


class ExperienceTransform(Protocol):
    """One algorithm's change to each step's experience. Every method is a collective over the actor ranks."""

    def before(self, step: int) -> dict[str, float]:
        """Before step ``step``'s experience is drawn (e.g. reset a reference and draw from it); its metrics."""
        return {}

    def __call__(self, step: int, experience: Experience) -> Experience:
        """Step ``step``'s experience, transformed; its metrics go into the new experience's ``metrics``."""


@dataclass(frozen=True)
class TransformSetup:
    """What a transform may be built from: the run's config and the parts of the run it may use."""

    cfg: Config
    engine: RolloutEngine  # the experience source's engine (samples the target model on the actor's behalf)
    pool: RewardPool
    loader: PromptLoader  # the training prompts' stream (read ahead only: restore its position)
    prompts: Sequence[PromptItem]  # every training prompt
    tokenizer: Any
    pad_id: int
    actor: Actor
    output_dir: Path  # the run directory, where a transform keeps its files
    start_step: int


Builder = Callable[[TransformSetup], ExperienceTransform]


Check = Callable[[Config], "str | None"]


@dataclass(frozen=True)
class Registration:
    name: str
    build: Builder
    enabled: Callable[[Config], bool]
    reserved_samples: int = 0
    stage: Stage = "rollouts"
    check: Check | None = None


_REGISTRY: dict[str, Registration] = {}


def experience_transform(
    name: str,
    *,
    enabled: Callable[[Config], bool],
    reserved_samples: int = 0,
    stage: Stage = "rollouts",
    check: Check | None = None,
) -> Callable[[Builder], Builder]:
    """Register the decorated builder as transform ``name`` (see the module doc)."""
    if stage not in STAGES:
        raise ValueError(f"experience_transform {name!r}: stage must be one of {STAGES}, got {stage!r}")
    if reserved_samples < 0:
        raise ValueError(f"experience_transform {name!r}: reserved_samples must be >= 0, got {reserved_samples}")

    def register(build: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name].build is not build:
            raise ValueError(f"experience_transform {name!r}: registered twice")
        _REGISTRY[name] = Registration(name, build, enabled, reserved_samples, stage, check)
        return build

    return register


@contextmanager
def registered(
    name: str,
    build: Builder,
    *,
    enabled: Callable[[Config], bool],
    reserved_samples: int = 0,
    stage: Stage = "rollouts",
    check: Check | None = None,
) -> Iterator[None]:
    """Transform ``name`` registered for the duration of the block (a transform from outside the package: tests)."""
    experience_transform(name, enabled=enabled, reserved_samples=reserved_samples, stage=stage, check=check)(build)
    try:
        yield
    finally:
        _REGISTRY.pop(name, None)


def registrations() -> list[Registration]:
    """Every registered transform, in the order they apply: by stage, then by name."""
    package = importlib.import_module(METHODS)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{METHODS}.{module.name}")
    return sorted(_REGISTRY.values(), key=lambda r: (STAGES.index(r.stage), r.name))


def enabled(cfg: Config) -> list[Registration]:
    """The transforms ``cfg`` asks for, in the order they apply, each one's ``check`` passed. Two that each add
    samples of their own to every group would each expect the group to be the policy's plus theirs: one at most."""
    chosen = [r for r in registrations() if r.enabled(cfg)]
    adding = [r.name for r in chosen if r.reserved_samples]
    if len(adding) > 1:
        raise ConfigError(f"algo: {' and '.join(adding)} both add samples of their own to each group; enable one")
    for registration in chosen:
        message = registration.check(cfg) if registration.check is not None else None
        if message:
            raise ConfigError(message)
    return chosen


def source_config(cfg: Config) -> Config:
    """The run's config as the experience source sees it: each group's samples less those the run's transforms add
    themselves."""
    reserved = sum(r.reserved_samples for r in enabled(cfg))
    if not reserved:
        return cfg
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, group_size=cfg.rollout.group_size - reserved)
    )


class Transforms:
    """The run's transforms, applied in order (a transform of none is the identity)."""

    def __init__(self, transforms: Sequence[ExperienceTransform]) -> None:
        self.transforms = list(transforms)

    @classmethod
    def build(cls, setup: TransformSetup) -> Transforms:
        return cls([r.build(setup) for r in enabled(setup.cfg)])

    def before(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for transform in self.transforms:
            metrics |= transform.before(step)
        return metrics

    def __call__(self, step: int, experience: Experience) -> Experience:
        for transform in self.transforms:
            experience = transform(step, experience)
        return experience
