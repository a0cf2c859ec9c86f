"""SFT on demonstrations, the off-policy corner of the SFT-to-RL grid (docs/algorithms.md, "The SFT-to-RL grid").

`Demonstrations(cfg, tokenizer, pool, pad_id)` (the transform registered as ``demonstrations``) turns a step's
experience into one whose every response is the prompt's reference solution (`reference_solution`: the task's own
solution; the embedded countdown task's is the first solution of its solver), ended as the engine's answers end (the
first of ``rollout.stop``, else the tokenizer's EOS). The reward pool scores the demonstrations (a demonstration the
verifier rejects keeps its reward), and the advantages are recomputed with ``algo.advantage.kind`` (``reward``: A =
r). The engine's log-probs of a demonstration are unknown (0). The step still samples its policy responses first:
``reward/*`` and ``response/*`` stay the policy's own behaviour on the step's prompts, ``demo/verified_frac`` is the
demonstrations' share with reward >= 1.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.data import PromptItem
from megatron_rlvr.errors import UserError
from megatron_rlvr.experience.collect import Experience, to_rollouts, verify
from megatron_rlvr.experience.transforms import ExperienceTransform, TransformSetup, experience_transform
from megatron_rlvr.protocols.handoffs import Targets
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import Completion

if TYPE_CHECKING:
    from megatron_rlvr.config import Config


def reference_solution(item: PromptItem) -> str:
    """The task's reference solution of ``item``: a dict answer's ``solution``, or for the embedded countdown task
    (whose answer is (numbers, target)) the first expression of the task's solver. A one-line UserError otherwise:
    a bare final answer is not a demonstration of how to reach it."""
    answer = item.answer
    if isinstance(answer, dict):
        solution = answer.get("solution")
        if isinstance(solution, str) and solution.strip():
            return solution
        if item.task == "countdown":
            from megatron_rlvr.tasks.countdown import reference_solution

            if (found := reference_solution(answer)) is not None:
                return found
    raise UserError(
        f"algo.demonstrations: prompt {item.id!r} (task {item.task!r}) has no reference solution to train on "
        f"(its answer is {answer!r}); SFT on demonstrations needs a task whose rows carry answer.solution, or countdown"
    )


@experience_transform("demonstrations", enabled=lambda cfg: cfg.algo.demonstrations)
def build(setup: TransformSetup) -> Demonstrations:
    return Demonstrations(setup.cfg, setup.tokenizer, setup.pool, setup.pad_id)


class Demonstrations(ExperienceTransform):
    """Replaces the responses of each step's experience by its prompts' demonstrations (see the module doc)."""

    def __init__(self, cfg: Config, tokenizer: Any, pool: RewardPool, pad_id: int) -> None:
        self.cfg, self.tokenizer, self.pool, self.pad_id = cfg, tokenizer, pool, pad_id
        self._cache: dict[str, Completion] = {}

    def completion(self, item: PromptItem) -> Completion:
        if item.id not in self._cache:
            text = reference_solution(item)
            stop = self.cfg.rollout.stop
            ids = list(self.tokenizer((text + stop[0]) if stop else text, add_special_tokens=False)["input_ids"])
            if not stop and self.tokenizer.eos_token_id is not None:
                ids.append(int(self.tokenizer.eos_token_id))
            self._cache[item.id] = Completion(token_ids=ids, logprobs=[], text=text, finish_reason="stop")
        return self._cache[item.id]

    def __call__(self, step: int, exp: Experience) -> Experience:
        g = self.cfg.rollout.group_size
        completions = [[self.completion(item)] * g for item in exp.items]
        rewards, counters = verify(self.pool, exp.items, completions)
        advantages, _ = compute_advantages(rewards, g, self.cfg.algo)
        verified = float((rewards >= 1.0).float().mean()) if len(rewards) else 0.0
        return dataclasses.replace(
            exp,
            completions=completions,
            rollouts=to_rollouts(exp.items, completions, rewards, self.pad_id),
            targets=Targets(advantages=advantages.float()),
            metrics=exp.metrics | {"demo/verified_frac": verified},
        )
