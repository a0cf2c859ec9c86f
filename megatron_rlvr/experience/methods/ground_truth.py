"""Ground-truth injection (docs/algorithms.md, "Ground-truth injection"): the prompt's reference solution is one
member of each group, beside the policy's G - 1 samples. Liu et al. (arXiv 2511.09222, "Toward Honest Language
Models for Deductive Reasoning") call the method Anchor; it is not ARMOR's anchors (experience/methods/armor.py),
which are the reference policy's own samples.

The transform (registered as ``ground_truth``, enabled by ``algo.ground_truth.enabled``) reserves one sample of
each group: the source samples ``rollout.group_size - 1`` per prompt, and `GroundTruthInjection` turns each group of
G - 1 policy samples into G:

- the reference is `demonstrations.reference_solution` of the prompt (a row's ``answer.solution``, countdown's first
  solver expression), tokenized as the demonstrations are (`Demonstrations.completion`: ended with the first of
  ``rollout.stop``, else EOS). A prompt without one is a one-line error naming it;
- the reward pool scores it like any response, and DAPO's overlong penalty applies to its length
  (`collect.group_of`). A reference the verifier rejects keeps the reward it was given and enters its group with it
  (a negative sample where the group has a correct one). ``ground_truth/verified_frac`` is the share of the step's references with reward >= 1;
- the advantages are ``algo.advantage`` over the G rewards, the reference's included (GRPO: the group's mean and
  std are taken over the G - 1 samples and the reference);
- the reference's row trains like a policy sample. Its engine log-probs are unknown (0), so the rollout correction,
  which reads them, is refused. The loss's ratio is rho_t = pi_theta / pi_old, where pi_old is the actor's behaviour
  log-prob of that row: the statistics pass, or (one mini-batch, no reference model) the update's own forward,
  detached, so rho = 1. It is clipped like every sample's.

What we take from the paper: ground-truth trajectories are injected into GRPO's rollouts, so that a group whose
samples are all wrong still carries a bounded positive signal. Its method text (where the trajectory sits in the
group, how its ratio is taken) was not available to us; the rest is ours, chosen as verl treats a response spliced
into a GRPO batch before the old-log-prob pass: the reference takes one of the G places, counts in the group's
statistics, and its behaviour log-prob is the actor's, as every row's is. LUFFY's off-policy ratio (behaviour
probability 1, no clip, a shaping function) would be a change to the loss, which this module leaves as it is.

``algo.ground_truth.groups: unsolved`` injects only where no policy sample has reward >= 1. In the other groups the
reference's row stays in place (fixed batch shape) but trains no token, and the G - 1 samples' advantages are
taken over their own rewards, as plain GRPO would take them.

Metrics: ``ground_truth/injected_frac`` (share of groups that took the reference), ``ground_truth/verified_frac``,
and ``ground_truth/advantage`` (mean advantage of the injected references; 0 when none was injected).
``reward/*`` and ``response/*`` stay the policy's own samples'.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.errors import UserError
from megatron_rlvr.experience.collect import Experience, group_of, to_rollouts, untruncated, verify
from megatron_rlvr.experience.methods.demonstrations import Demonstrations
from megatron_rlvr.experience.transforms import ExperienceTransform, TransformSetup, experience_transform
from megatron_rlvr.protocols.handoffs import Targets
from megatron_rlvr.rewards import RewardPool

if TYPE_CHECKING:
    from megatron_rlvr.config import Config
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.rollout import Completion


def refusal(cfg: Config) -> str | None:
    """What in ``cfg`` ground-truth injection cannot run beside, as one line; None when nothing."""
    g = cfg.rollout.group_size
    if g < 2:
        return (
            f"algo.ground_truth.enabled: rollout.group_size={g} leaves no policy sample beside the reference; set >= 2"
        )
    if cfg.algo.demonstrations:
        return "algo.ground_truth.enabled: not with algo.demonstrations, which replaces every response by the reference"
    if cfg.algo.drop_uniform_groups:
        return (
            "algo.ground_truth.enabled: not with algo.drop_uniform_groups (dynamic sampling would drop the groups with "
            "no correct sample before the reference joins them)"
        )
    if cfg.algo.rollout_correction.kind != "none":
        return (
            f"algo.ground_truth.enabled: algo.rollout_correction.kind={cfg.algo.rollout_correction.kind} reads the "
            "engine's log-probs, and no engine sampled the reference; set algo.rollout_correction.kind=none"
        )
    if cfg.actor.router_replay == "rollout":
        return (
            "algo.ground_truth.enabled: the reference carries no engine routing to replay; set actor.router_replay="
            "train or none"
        )
    return None


@experience_transform(
    "ground_truth", enabled=lambda cfg: cfg.algo.ground_truth.enabled, reserved_samples=1, check=refusal
)
def build(setup: TransformSetup) -> GroundTruthInjection:
    return GroundTruthInjection(setup.cfg, setup.tokenizer, setup.pool, setup.pad_id)


class GroundTruthInjection(ExperienceTransform):
    """Adds each prompt's reference solution to its group (see the module doc)."""

    def __init__(self, cfg: Config, tokenizer: Any, pool: RewardPool, pad_id: int) -> None:
        self.cfg, self.pool, self.pad_id = cfg, pool, pad_id
        # one home for how a reference solution becomes a response (cached per prompt)
        self._references = Demonstrations(cfg, tokenizer, pool, pad_id)

    def reference(self, item: PromptItem) -> Completion:
        try:
            return self._references.completion(item)
        except UserError:
            raise UserError(
                f"algo.ground_truth: prompt {item.id!r} (task {item.task!r}) has no reference solution to inject "
                f"(its answer is {item.answer!r}); a task whose rows carry answer.solution, or countdown, is needed"
            ) from None

    def __call__(self, step: int, experience: Experience) -> Experience:
        references = [self.reference(item) for item in experience.items]
        return with_references(experience, references, self.pool, self.cfg, self.pad_id)


def with_references(
    exp: Experience, references: list[Completion], pool: RewardPool, cfg: Config, pad_id: int
) -> Experience:
    """G - 1 policy samples per group + its prompt's reference (last) -> the G-sample `Experience`: the references
    scored, the advantages over each group's G rewards (over the G - 1 policy samples' where the reference does not
    join: ``groups: unsolved``), the ground_truth/* metrics among its metrics."""
    g = cfg.rollout.group_size
    policy_g = g - 1
    if len(exp.completions) != len(exp.items) or any(len(c) != policy_g for c in exp.completions):
        raise ValueError(
            f"ground truth: expected {policy_g} policy samples per group (rollout.group_size - 1), got "
            f"{[len(c) for c in exp.completions]}"
        )
    verified, _ = verify(pool, exp.items, [[r] for r in references])
    only_unsolved = cfg.algo.ground_truth.groups == "unsolved"
    rewards, advantages, joined = [], [], []
    for i, (item, reference) in enumerate(zip(exp.items, references)):
        own = exp.rollouts.rewards[i * policy_g : (i + 1) * policy_g]  # their overlong penalty already added
        reference_reward = group_of(0, i, item, [reference], verified[i : i + 1], cfg).rewards
        joins = not (only_unsolved and bool((own >= 1.0).any()))
        if joins:
            group_advantages, _ = compute_advantages(torch.cat([own, reference_reward]), g, cfg.algo)
        else:
            own_advantages, _ = compute_advantages(own, policy_g, cfg.algo)
            group_advantages = torch.cat([own_advantages, torch.zeros(1)])
        rewards.append(torch.cat([own, reference_reward]))
        advantages.append(group_advantages)
        joined.append(joins)
    completions = [[*group, reference] for group, reference in zip(exp.completions, references)]
    flat_rewards, flat_advantages = torch.cat(rewards), torch.cat(advantages)
    is_reference = (torch.arange(len(flat_rewards)) % g) == g - 1
    injected = is_reference & torch.tensor(joined).repeat_interleave(g)
    trains = (~is_reference | injected) & untruncated(completions, cfg.algo.mask_truncated)
    n = max(len(exp.items), 1)
    metrics = {
        "ground_truth/injected_frac": sum(joined) / n,
        "ground_truth/verified_frac": float((verified >= 1.0).sum()) / n,
        "ground_truth/advantage": float(flat_advantages[injected].mean()) if injected.any() else 0.0,
    }
    return dataclasses.replace(
        exp,
        completions=completions,
        rollouts=to_rollouts(exp.items, completions, flat_rewards, pad_id, trains=trains),
        targets=Targets(advantages=flat_advantages.float()),
        metrics=exp.metrics | metrics,
    )
