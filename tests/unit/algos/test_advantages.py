"""Group advantages: GRPO normalization, Dr.GRPO centring, uniform groups, and input errors."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.testing.configs import algo_config


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, keep = compute_advantages(rewards, 4, algo_config({"advantage.eps": 0.0}))
    # group 1: mean 0.25, unbiased std sqrt(0.25 * 0.75 * 4 / 3) = 0.5
    torch.testing.assert_close(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    assert torch.equal(adv[4:], torch.zeros(4))
    assert keep.all()


def test_dr_grpo_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0])
    adv, _ = compute_advantages(rewards, 3, algo_config({"advantage.normalize_std": False}))
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 4 / 3, -2 / 3]))


def test_uniform_groups_are_dropped_when_asked():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.3, 0.3])
    adv, keep = compute_advantages(rewards, 2, algo_config({"drop_uniform_groups": True}))
    assert keep.tolist() == [False, False, True, True, False, False]
    assert adv[0] == adv[1] == adv[4] == adv[5] == 0.0
    assert adv[2] > 0 > adv[3]
    assert adv.dtype == torch.float32


def test_group_of_one_gives_zero():
    adv, _ = compute_advantages(torch.tensor([1.0, 0.0]), 1, algo_config())
    assert torch.equal(adv, torch.zeros(2))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.zeros(6), 4, algo_config())
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.zeros(2, 3), 3, algo_config())
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.tensor([1.0, float("nan")]), 2, algo_config())


def test_raw_reward_advantages_take_no_group_statistics():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    adv, keep = compute_advantages(rewards, 4, algo_config({"advantage.kind": "reward"}))
    assert torch.equal(adv, rewards) and keep.all()  # an all-correct group trains too
    signed, _ = compute_advantages(rewards, 4, algo_config({"advantage.kind": "signed_reward"}))
    assert torch.equal(signed, 2 * rewards - 1)
    _, keep = compute_advantages(rewards, 2, algo_config({"advantage.kind": "reward", "drop_uniform_groups": True}))
    assert keep.tolist() == [True, True, False, False, False, False, True, True]  # dynamic sampling still drops
    with pytest.raises(ValueError, match=r"^algo.advantage.kind: got 'baseline'; allowed values: 'group', 'reward'"):
        algo_config({"advantage.kind": "baseline"})
