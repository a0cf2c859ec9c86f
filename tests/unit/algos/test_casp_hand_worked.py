"""CaSP on a 5-token vocabulary, worked by hand: the exact target weights and the rank-1 penalty.

With p = softmax(z) and one response token with A * rho = 1, the gradient of ``-sum_k q_k log p_k`` w.r.t. the
logits is ``p - q`` (q sums to 1), so the gradient shows the target distribution q CaSP trains towards; for a
negative sample it is ``-(scale) * (e_y - p)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.algos import policy_loss
from megatron_rlvr.testing.configs import algo_config
from tests.unit.algos.stats_providers import PROVIDERS

P = [0.4, 0.3, 0.15, 0.1, 0.05]  # ranks 1..5 are tokens 0..4
CASP = {"loss.kind": "casp", "loss.top_n": 3, "loss.alpha": 0.3, "loss.lambda_top1": 0.5, "loss.tau_q": 0.0}


def _gradient(provider, probs, sampled, advantage, cfg):
    logits = torch.tensor([[[math.log(p) for p in row] for row in probs]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([sampled])
    stats = PROVIDERS[provider](logits, targets, 3)
    old_logp = stats.logp.detach().clone()  # rho = 1
    mask = torch.ones(1, len(probs), dtype=torch.bool)
    loss, metrics = policy_loss(
        stats, old_logp, torch.tensor([advantage], dtype=torch.float64), mask, cfg, target_ids=targets
    )
    loss.backward()
    return logits.grad[0].to(torch.float64), metrics


def _tol(provider):
    return dict(rtol=0, atol=1e-12 if provider == "dense" else 2e-6)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "sampled, target",
    [
        (3, [0.1, 0.1, 0.1, 0.7, 0.0]),  # y outside the top 3: (1 - alpha) on y, alpha / 3 on each candidate
        (0, [0.8, 0.1, 0.1, 0.0, 0.0]),  # y is rank 1: it gets both shares
        (2, [0.1, 0.1, 0.8, 0.0, 0.0]),  # y is rank 3
    ],
)
def test_positive_sample_trains_towards_the_smoothed_target(provider, sampled, target):
    grad, _ = _gradient(provider, [P], [sampled], 1.0, algo_config({**CASP}))
    torch.testing.assert_close(
        grad[0], torch.tensor(P, dtype=torch.float64) - torch.tensor(target, dtype=torch.float64), **_tol(provider)
    )


@pytest.mark.parametrize("provider", PROVIDERS)
def test_softmax_weights_follow_the_candidates_probabilities(provider):
    grad, _ = _gradient(provider, [P], [3], 1.0, algo_config({**CASP, "loss.weights": "softmax"}))
    top = 0.4 + 0.3 + 0.15
    target = [0.3 * 0.4 / top, 0.3 * 0.3 / top, 0.3 * 0.15 / top, 0.7, 0.0]
    torch.testing.assert_close(
        grad[0], torch.tensor(P, dtype=torch.float64) - torch.tensor(target, dtype=torch.float64), **_tol(provider)
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("sampled, scale", [(0, 1.5), (1, 1.0), (4, 1.0)])
def test_negative_sample_penalty_is_harder_only_on_rank1(provider, sampled, scale):
    grad, metrics = _gradient(provider, [P], [sampled], -1.0, algo_config({**CASP}))
    onehot = torch.zeros(5, dtype=torch.float64)
    onehot[sampled] = 1.0
    # loss = -(A * scale) * logp_y = scale * logp_y, so dL/dz = scale * (e_y - p)
    torch.testing.assert_close(grad[0], scale * (onehot - torch.tensor(P, dtype=torch.float64)), **_tol(provider))
    assert metrics["neg_rank1_frac"] == (1.0 if sampled == 0 else 0.0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_only_the_high_entropy_token_of_a_response_is_smoothed(provider):
    peaked = [0.9, 0.05, 0.03, 0.01, 0.01]
    cfg = algo_config(
        {**{**CASP, "loss.tau_q": 0.8}}
    )  # of two tokens, only the higher-entropy one is above the quantile
    grad, metrics = _gradient(provider, [P, peaked], [3, 3], 1.0, cfg)
    assert metrics["high_entropy_frac"] == 0.5
    smoothed = torch.tensor(P, dtype=torch.float64) - torch.tensor([0.1, 0.1, 0.1, 0.7, 0.0], dtype=torch.float64)
    plain = torch.tensor(peaked, dtype=torch.float64) - torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    # token_mean over the response's two tokens
    torch.testing.assert_close(grad[0], smoothed / 2, **_tol(provider))
    torch.testing.assert_close(grad[1], plain / 2, **_tol(provider))
