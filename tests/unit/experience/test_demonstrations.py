"""SFT on demonstrations (experience/methods/demonstrations.py): the countdown task's reference solution becomes every
response of its group, ended like the engine's answers, verified by the reward pool, with raw-reward advantages; a
task without reference solutions is a one-line error."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem
from megatron_rlvr.errors import UserError
from megatron_rlvr.experience.collect import Experience, to_rollouts
from megatron_rlvr.experience.methods.demonstrations import Demonstrations, reference_solution
from megatron_rlvr.protocols import Targets
from megatron_rlvr.rewards.countdown import score_countdown
from megatron_rlvr.rollout import Completion, RolloutConfig
from megatron_rlvr.testing.configs import algo_config, run_config
from tests.unit.experience.reference_fakes import CharTokenizer, CountdownPool

COUNTDOWN = PromptItem("cd0", "", (5, 6), {"numbers": [3, 4, 5, 6], "target": 24}, "countdown")


def test_countdown_demonstrations_replace_the_samples():
    cfg = Config(
        algo=algo_config({"loss.kind": "psr", "advantage.kind": "reward", "demonstrations": True}),
        rollout=RolloutConfig(group_size=2, stop=["\n"]),
    )
    solution = reference_solution(COUNTDOWN)
    assert score_countdown(solution, COUNTDOWN.answer) == 1.0
    sampled = [[Completion([1, 2], [-0.1, -0.2], "nope", "stop")] * 2]
    rollouts = to_rollouts([COUNTDOWN], sampled, torch.zeros(2), 0)
    exp = Experience([COUNTDOWN], sampled, rollouts, Targets(advantages=torch.zeros(2)), {}, {"reward/mean": 0.0})
    out = Demonstrations(cfg, CharTokenizer(), CountdownPool(), pad_id=0)(0, exp)
    ids = [ord(c) for c in solution + "\n"]
    assert out.completions[0][0].token_ids == ids and out.rollouts.rewards.tolist() == [1.0, 1.0]
    assert out.targets.advantages.tolist() == [1.0, 1.0]  # A = r: every demonstration a positive sample
    assert out.rollouts.response_mask.sum(-1).tolist() == [len(ids)] * 2
    assert out.metrics == {"reward/mean": 0.0, "demo/verified_frac": 1.0}  # reward/* stays the policy's own


def test_a_task_without_reference_solutions_is_one_line():
    item = PromptItem("m1", "", (1,), "42", "math")
    with pytest.raises(UserError, match=r"^algo.demonstrations: prompt 'm1' \(task 'math'\) has no reference solution"):
        reference_solution(item)
    assert reference_solution(PromptItem("m2", "", (1,), {"solution": "2 + 2 = 4"}, "math")) == "2 + 2 = 4"
    with pytest.raises(ValueError, match=r"^algo.advantage.kind: expected 'reward' or 'signed_reward' under algo.demo"):
        run_config({"algo.demonstrations": True})
