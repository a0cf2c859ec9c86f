"""The SFT-to-RL grid's corners as losses (docs/algorithms.md, "The SFT-to-RL grid"), on-policy, against plain
negative log-likelihood formulas in float64: rejection-sampling fine-tuning (psr on raw rewards) is the NLL of the
rewarded samples, REINFORCE with negatives (grpo on signed rewards) the NLL weighted by +-1; token_mean over every
response token."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.algos import compute_advantages, policy_loss
from megatron_rlvr.testing.configs import algo_config
from tests.support.algos.dense_reference import dense_token_stats, random_problem


def _grid_cell(problem, rewards, cfg):
    logits = problem.logits.clone().requires_grad_(True)
    stats = dense_token_stats(logits, problem.targets, 3)
    advantages, _ = compute_advantages(rewards, len(rewards), cfg)
    loss, _ = policy_loss(stats, None, advantages.double(), problem.mask, cfg, target_ids=problem.targets)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def _weighted_nll(problem, weights):
    logits = problem.logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1).gather(-1, problem.targets[..., None])[..., 0]
    nll = -(weights[:, None] * torch.where(problem.mask, logp, torch.zeros_like(logp))).sum() / problem.mask.sum()
    (grad,) = torch.autograd.grad(nll, logits)
    return grad


@pytest.mark.parametrize("seed", [31, 32])
def test_rejection_sampling_fine_tuning_is_the_nll_of_correct_samples(seed):
    problem = random_problem(seed)
    rewards = (torch.arange(problem.mask.shape[0]) % 2 == 0).float()
    loss, grad = _grid_cell(problem, rewards, algo_config({"loss.kind": "psr", "advantage.kind": "reward"}))
    torch.testing.assert_close(grad, _weighted_nll(problem, rewards.double()), rtol=1e-12, atol=1e-14)
    # on-policy the clipped surrogate's value is -agg(A) over the trained tokens: minus the rewarded token share
    share = float((rewards.double()[:, None] * problem.mask).sum() / problem.mask.sum())
    assert float(loss) == pytest.approx(-share, rel=1e-12)


@pytest.mark.parametrize("seed", [31, 32])
def test_reinforce_with_negatives_is_the_signed_nll(seed):
    problem = random_problem(seed)
    rewards = (torch.arange(problem.mask.shape[0]) % 3 == 0).float()
    _, grad = _grid_cell(problem, rewards, algo_config({"loss.kind": "grpo", "advantage.kind": "signed_reward"}))
    torch.testing.assert_close(grad, _weighted_nll(problem, 2 * rewards.double() - 1), rtol=1e-12, atol=1e-14)
