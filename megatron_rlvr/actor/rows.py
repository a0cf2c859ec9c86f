"""`TrainingRows`: what the update's loss reads of each sequence, joined from the step's hand-offs.

The update plans, packs and micro-batches rows; each micro-batch's loss reads the rows' tokens and mask, their
targets, the statistics of the passes before it and the engine's log-probs. `TrainingRows.join` puts those side by
side without copying a tensor (the fields are the hand-offs' own tensors, and ``select`` makes new ones), so the
update writes nothing into what experience collection or ``score`` made. It is the actor's own view: nothing
outside the actor sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.protocols.handoffs import ContextGroups, Rollouts, Sequences, Statistics, Targets


@dataclass(frozen=True, kw_only=True)
class TrainingRows(Sequences):
    """One row per sequence: the rollouts' tokens (with the routing the update replays), the loss's inputs."""

    advantages: Tensor  # [B]
    engine_logp: Tensor | None = None  # [B, S - 1] the engine's log-probs (the rollout correction)
    kl_coef: Tensor | None = None  # [B] per-sequence KL coefficients, in place of the loss's global one
    old_logp: Tensor | None = None  # [B, S - 1] None: the update is on-policy and takes its own
    ref_logp: Tensor | None = None  # [B, S - 1]
    teacher: TeacherScores | None = None
    context_groups: ContextGroups | None = None
    # CRPO: the per-position (coefficient, value share) of the contrastive term, from the update's first pass over
    # the mini-batch (actor/contrast.py)
    crpo_weights: Tensor | None = None  # [B, S - 1, 2]

    @classmethod
    def join(cls, rollouts: Rollouts, targets: Targets, statistics: Statistics) -> TrainingRows:
        """The update's rows: the routing is the statistics pass's when it recorded one, else the engine's."""
        routed = statistics.routed_experts if statistics.routed_experts is not None else rollouts.routed_experts
        return cls(
            tokens=rollouts.tokens,
            response_mask=rollouts.response_mask,
            routed_experts=routed,
            advantages=targets.advantages,
            engine_logp=rollouts.engine_logp,
            kl_coef=targets.kl_coef,
            old_logp=statistics.old_logp,
            ref_logp=statistics.ref_logp,
            teacher=statistics.teacher,
            context_groups=statistics.context_groups,
        )
