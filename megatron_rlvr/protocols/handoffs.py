"""What one stage of a training step hands the next, one frozen type per hand-off:

- `Rollouts` (experience collection): the sampled sequences as the actor reads them, the engine's log-probs of the
  sampled tokens, the rewards, and (routing replay) the engine's experts;
- `Targets` (experience collection and the algorithm's experience transforms): what the loss is asked to do with each
  sequence, its advantage and, where an algorithm sets one, its own KL coefficient;
- `Statistics` (``actor.score``): what the actor's no-grad passes computed at the weights the update starts from,
  the behaviour log-probs, the frozen reference's, the teacher's scores;
- the update's metrics (``actor.update``), plain floats.

Nothing here is written after it is made: a stage that needs something else makes a new object
(``dataclasses.replace``) and the tensors it did not change are shared, never copied. Every type is a table of
rows, one per sequence, so ``select`` (rows by index) and ``to`` (a device) apply to each tensor alike. Position t
of a [B, S - 1] field belongs to token t + 1. Plain tensors only: importing this module imports torch and nothing
else of the project but the teacher's score type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from megatron_rlvr.algos.distill import TeacherScores


def _map_rows(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``fn`` on every tensor of ``value`` (a tensor, None, or a dataclass of them, nested)."""
    if isinstance(value, Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: _map_rows(getattr(value, f.name), fn) for f in dataclasses.fields(value)}
        )
    return value


R = TypeVar("R", bound="Rows")


class Rows:
    """A frozen dataclass whose tensors (and nested dataclasses of tensors) all have one row per sequence."""

    def select(self: R, index: Tensor | slice) -> R:
        """The rows ``index`` of every field, as a new object (nothing is written)."""
        return _map_rows(self, lambda t: t[index])

    def to(self: R, device: torch.device) -> R:
        return _map_rows(self, lambda t: t.to(device))


@dataclass(frozen=True, kw_only=True)
class Sequences(Rows):
    """Token sequences as every actor pass reads them: prompt + response, right-padded to one length."""

    tokens: Tensor  # [B, S] int64
    response_mask: Tensor  # [B, S - 1] bool: position t trains token t + 1
    # MoE routing replay (actor.router_replay): the top-k experts of every token at every MoE layer, -1 unknown
    routed_experts: Tensor | None = None  # [B, S, MoE layers, top_k] integer expert ids

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True, kw_only=True)
class Rollouts(Sequences):
    """What experience collection sampled and scored: the sequences that train (``response_mask`` holds only the
    response tokens that train: not a weaker model's prefix, an environment's tokens or a dropped group's), the
    engine's log-probs at the response positions (0 elsewhere; what the rollout correction reads) and each
    sequence's reward (the overlong penalty included). ``routed_experts``: the engine's routing (``rollout``)."""

    engine_logp: Tensor  # [B, S - 1]
    rewards: Tensor  # [B] float32


@dataclass(frozen=True, kw_only=True)
class Targets(Rows):
    """What the loss is asked to do with each sequence."""

    advantages: Tensor  # [B] float32
    # the KL term's coefficient of each sequence in place of the loss's global one (None: the global one)
    kl_coef: Tensor | None = None  # [B] float32


@dataclass(frozen=True, kw_only=True)
class ContextGroups(Rows):
    """The groups of a teacher whose privileged context is a correct response of the row's own group (CRPO): each
    row's group and whether that group has a correct response (else the row has no context)."""

    group: Tensor  # [B] int64
    has_context: Tensor  # [B] bool


@dataclass(frozen=True, kw_only=True)
class Statistics(Rows):
    """What the actor's no-grad passes computed over a `Rollouts`, at the weights the update starts from; a field
    is None where the run's loss does not read it."""

    # the behaviour log-probs; None when the update is exactly on-policy and takes its own forward's
    old_logp: Tensor | None = None  # [B, S - 1]
    ref_logp: Tensor | None = None  # [B, S - 1] of the frozen reference, when the loss reads one
    teacher: TeacherScores | None = None  # the distillation teacher's scores of the response tokens
    context_groups: ContextGroups | None = None  # the teacher's context groups (CRPO)
    # the routing the statistics pass recorded (actor.router_replay: train), replayed by every later pass
    routed_experts: Tensor | None = None  # [B, S, MoE layers, top_k]
