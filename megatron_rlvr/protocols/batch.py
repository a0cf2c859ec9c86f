"""`SequenceBatch`: the loop's hand-off type, rollouts as every actor pass reads them.

Experience collection builds one (experience/collect.py), the actor's passes fill its per-token fields
(``old_logp``, ``ref_logp``) and train on it, and validation measures entropy on one. Plain tensors only: importing
this module imports torch and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceBatch:
    """Rollouts as the actor trains on them; position t of the statistics predicts token t + 1."""

    tokens: torch.Tensor  # [B, S] int64, prompt + response, right-padded
    response_mask: torch.Tensor  # [B, S - 1] bool: target position t+1 is a response token
    advantages: torch.Tensor  # [B] float32
    old_logp: torch.Tensor | None = None  # [B, S - 1] from the statistics pass
    ref_logp: torch.Tensor | None = None  # [B, S - 1] of the frozen reference, when the loss has a KL term
    rollout_logp: torch.Tensor | None = None  # [B, S - 1] the engine's log-probs of the sampled tokens (responses)
    kl_coef: torch.Tensor | None = None  # [B] the KL term's coefficient per sequence (PBA), in place of algo.kl_coef
    # the distillation teacher's scores of the response tokens (actor/teacher.py): log-prob, top-N ids, logits at them
    teacher_logp: torch.Tensor | None = None  # [B, S - 1]
    teacher_ids: torch.Tensor | None = None  # [B, S - 1, N]
    teacher_logits: torch.Tensor | None = None  # [B, S - 1, N]
    # CRPO (algo.distill: crpo, algos/crpo.py): the rewards choose each row's privileged context (a correct response
    # of its group); the teacher's attach gives each row its group and whether the group has a correct response, and
    # the update's first pass the per-position (coefficient, value share) of the contrastive term
    rewards: torch.Tensor | None = None  # [B]
    crpo_group: torch.Tensor | None = None  # [B] int64
    crpo_context: torch.Tensor | None = None  # [B] bool
    crpo_weights: torch.Tensor | None = None  # [B, S - 1, 2]
    # MoE routing replay (actor.router_replay): the top-k experts of every token at every MoE layer
    routed_experts: torch.Tensor | None = None  # [B, S, MoE layers, top_k] integer expert ids

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, fn) -> SequenceBatch:
        return SequenceBatch(
            *(
                None if t is None else fn(t)
                for t in (
                    self.tokens,
                    self.response_mask,
                    self.advantages,
                    self.old_logp,
                    self.ref_logp,
                    self.rollout_logp,
                    self.kl_coef,
                    self.teacher_logp,
                    self.teacher_ids,
                    self.teacher_logits,
                    self.rewards,
                    self.crpo_group,
                    self.crpo_context,
                    self.crpo_weights,
                    self.routed_experts,
                )
            )
        )

    def select(self, index: torch.Tensor | slice) -> SequenceBatch:
        return self._map(lambda t: t[index])

    def to(self, device: torch.device) -> SequenceBatch:
        return self._map(lambda t: t.to(device))
