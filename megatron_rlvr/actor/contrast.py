"""CRPO's first pass (algos/crpo.py): the policy's per-position sim and dE on the teacher's top-K support over a whole
mini-batch, without grad, then the group-coupled weights every micro-batch's loss reads.

``contrast_weights(passes, model, mini, planned, cfg)`` runs the policy forward only through the actor's own passes
(the same plan, packing and schedule as the update that follows, at the same weights), gathers (sim, dE)
[B, S - 1] of every sequence to every rank, and returns ``group_weights`` of the mini-batch: the weights
[B, S - 1, 2] the update's rows carry (``TrainingRows.crpo_weights``) and the ``crpo/*`` metrics. The second pass
is the update itself (``policy_loss(..., crpo_weights=)``).
"""

from __future__ import annotations

import torch

from megatron_rlvr.actor.packing import MicroBatch, Plan
from megatron_rlvr.actor.passes import ActorPasses
from megatron_rlvr.actor.rows import TrainingRows
from megatron_rlvr.actor.teacher import student_logits_at
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.crpo import group_weights, support_terms


@torch.no_grad()
def contrast_weights(
    passes: ActorPasses,
    model: list[torch.nn.Module],
    mini: TrainingRows,
    planned: tuple[Plan, list[MicroBatch]],
    cfg: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(``crpo_weights`` [B, S - 1, 2] of ``mini``, the ``crpo/*`` metrics), the same on every rank; ``planned`` is
    ``passes.plan(mini)``."""
    teacher, groups = mini.teacher, mini.context_groups
    if teacher is None or groups is None:
        raise ValueError(
            "statistics: algo.distill.kind=crpo needs the teacher's scores and context groups (Teacher.scores)"
        )
    plan, micro = planned
    width = mini.response_mask.shape[1]

    def collect(mb: MicroBatch, logits: torch.Tensor):
        seqs = mb.seqs
        if not isinstance(seqs, TrainingRows) or seqs.teacher is None:  # rows of ``mini``, which has them
            raise TypeError("contrast_weights: a micro-batch without the teacher's scores")
        _, at = student_logits_at(passes, logits, mb, seqs.teacher.topn_ids)
        device = at.device
        mask = seqs.response_mask.to(device=device, dtype=torch.bool)
        sim, d_entropy = support_terms(at, seqs.teacher.topn_logits.to(device), mask)
        return torch.zeros(()), {"crpo": torch.cat([sim, d_entropy], dim=1).float()}

    outputs = passes.run(micro, collect, forward_only=True, model=model)
    values = passes.gather([o["crpo"] for o in outputs], plan, len(mini), 2 * width)
    return group_weights(
        values[:, :width], values[:, width:], mini.response_mask, groups.group, groups.has_context, cfg
    )
