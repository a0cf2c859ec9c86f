"""CaSP's adaptive candidate sets (docs/algorithms.md, "Adaptive candidates"): the set rule, a hand-worked target, its two limits
(candidate_mass = 1 is the fixed top-N bit for bit; a tiny mass is CaSP with top_n = 1) and the dense oracle.
The op at TP = 1 / 2 is in test_losses_op.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.algos import LOSS_NAMES, policy_loss
from megatron_rlvr.algos.token_masks import adaptive_candidates
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.testing.configs import algo_config, replaced
from tests.support.algos.dense_reference import (
    LOSS_COEFFICIENTS,
    candidate_set_size,
    dense_token_stats,
    random_problem,
    reference_loss,
)
from tests.unit.algos.stats_providers import PROVIDERS

BASE = LOSS_COEFFICIENTS
ADAPTIVE = {"loss.kind": "casp", "loss.candidates": "adaptive", "loss.candidate_mass": 0.5, "loss.top_n": 4}


def test_the_set_is_the_smallest_top_ranked_prefix_reaching_the_mass():
    logp = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64).log()
    sizes = {m: int(adaptive_candidates(logp, m).sum()) for m in (1e-9, 0.3, 0.6, 0.8, 0.9, 0.99, 1.0)}
    assert sizes == {1e-9: 1, 0.3: 1, 0.6: 2, 0.8: 3, 0.9: 4, 0.99: 4, 1.0: 4}  # rank 1 always; at most N
    # A prefix whose mass equals candidate_mass exactly has reached it: the next rank stays out.
    first = float(logp[0].exp())
    assert adaptive_candidates(logp, first).tolist() == [True, False, False, False]
    assert adaptive_candidates(logp, math.nextafter(first, 1.0)).tolist() == [True, True, False, False]
    # batched: each token its own set; a prefix mask (no holes)
    rows = torch.stack([logp, torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float64).log()])
    assert adaptive_candidates(rows, 0.8).tolist() == [[True, True, True, False], [True, False, False, False]]


def _one_token_gradient(provider, probs, sampled, cfg):
    """Gradient of the loss w.r.t. the logits of one positive token with A * rho = 1: p - q, q the target."""
    logits = torch.tensor([[[math.log(p) for p in row] for row in probs]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([sampled])
    stats = PROVIDERS[provider](logits, targets, max(cfg.loss.top_n, 3))
    mask = torch.ones(1, len(probs), dtype=torch.bool)
    loss, metrics = policy_loss(
        stats, stats.logp.detach().clone(), torch.tensor([1.0], dtype=torch.float64), mask, cfg, target_ids=targets
    )
    loss.backward()
    return logits.grad[0], metrics


P = [0.4, 0.3, 0.15, 0.1, 0.05]  # ranks 1..5 are tokens 0..4; mass of ranks 1, 1-2, 1-3: 0.4, 0.7, 0.85


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "mass, weights, target",
    [
        (0.5, "uniform", [0.15, 0.15, 0.0, 0.7, 0.0]),  # C = ranks 1-2: alpha / 2 each, (1 - alpha) on y
        (0.3, "uniform", [0.3, 0.0, 0.0, 0.7, 0.0]),  # rank 1 alone reaches 0.3
        (0.8, "uniform", [0.1, 0.1, 0.1, 0.7, 0.0]),  # ranks 1-3
        (0.95, "uniform", [0.1, 0.1, 0.1, 0.7, 0.0]),  # not reached by the top 3: capped at top_n = 3
        (0.5, "softmax", [0.3 * 0.4 / 0.7, 0.3 * 0.3 / 0.7, 0.0, 0.7, 0.0]),  # renormalized over C
    ],
)
def test_positive_token_trains_towards_the_smoothed_target_over_the_set(provider, mass, weights, target):
    cfg = algo_config(
        {
            "loss.kind": "casp",
            "loss.top_n": 3,
            "loss.alpha": 0.3,
            "loss.tau_q": 0.0,
            "loss.candidates": "adaptive",
            "loss.candidate_mass": mass,
            "loss.weights": weights,
        }
    )
    grad, metrics = _one_token_gradient(provider, [P], [3], cfg)
    expected = torch.tensor(P, dtype=torch.float64) - torch.tensor(target, dtype=torch.float64)
    torch.testing.assert_close(grad[0], expected, rtol=0, atol=1e-12 if provider == "dense" else 2e-6)
    assert metrics["casp_candidates"] == sum(1 for t in target[:3] if t > 0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_token_gets_its_own_set_and_the_metric_is_their_mean_size(provider):
    peaked, flat = [0.9, 0.05, 0.03, 0.01, 0.01], [0.3, 0.25, 0.2, 0.15, 0.1]
    cfg = algo_config(
        {
            "loss.kind": "casp",
            "loss.top_n": 3,
            "loss.alpha": 0.3,
            "loss.tau_q": 0.0,
            "loss.candidates": "adaptive",
            "loss.candidate_mass": 0.8,
        }
    )
    grad, metrics = _one_token_gradient(provider, [peaked, flat], [2, 4], cfg)
    tol = dict(rtol=0, atol=1e-12 if provider == "dense" else 2e-6)
    # peaked: rank 1 alone holds 0.9 >= 0.8; flat: 0.75 after three ranks, capped at 3. token_mean over 2 tokens.
    q_peaked = torch.tensor([0.3, 0.0, 0.7, 0.0, 0.0], dtype=torch.float64)
    q_flat = torch.tensor([0.1, 0.1, 0.1, 0.0, 0.7], dtype=torch.float64)
    torch.testing.assert_close(grad[0], (torch.tensor(peaked, dtype=torch.float64) - q_peaked) / 2, **tol)
    torch.testing.assert_close(grad[1], (torch.tensor(flat, dtype=torch.float64) - q_flat) / 2, **tol)
    assert metrics["casp_candidates"] == 2.0 and metrics["casp_smoothed_tokens"] == 2.0  # (1 + 3) / 2 over 2


def _loss_and_grad(problem, cfg, stats_fn, dtype):
    logits = problem.logits.to(dtype).clone().requires_grad_(True)
    stats = stats_fn(logits, problem.targets, max(cfg.loss.top_n, 3))
    loss, metrics = policy_loss(
        stats, problem.old_logp.to(dtype), problem.advantages.to(dtype), problem.mask, cfg, target_ids=problem.targets
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


def _op(logits, targets, top_n):
    return vocab_parallel_token_stats(logits, targets, top_n)


STATS = {"dense": (dense_token_stats, torch.float64), "op_fp32": (_op, torch.float32)}


@pytest.mark.parametrize("stats", STATS)
@pytest.mark.parametrize("weights", ["uniform", "softmax"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_mass_one_is_the_fixed_top_n_bit_for_bit(stats, weights, loss_agg):
    fixed = algo_config(
        {**{**BASE, "loss.kind": "casp", "loss.top_n": 3, "loss.weights": weights, "loss.agg": loss_agg}}
    )
    adaptive = replaced(fixed, {"loss.candidates": "adaptive", "loss.candidate_mass": 1.0})
    fn, dtype = STATS[stats]
    for seed in range(3):
        problem = random_problem(800 + seed)
        loss_f, grad_f, metrics_f = _loss_and_grad(problem, fixed, fn, dtype)
        loss_a, grad_a, metrics_a = _loss_and_grad(problem, adaptive, fn, dtype)
        assert torch.equal(loss_a, loss_f) and torch.equal(grad_a, grad_f)
        assert metrics_a.pop("casp_candidates") == 3.0 and metrics_a.pop("casp_smoothed_tokens") > 0
        assert metrics_a == metrics_f


@pytest.mark.parametrize("stats", STATS)
@pytest.mark.parametrize("weights", ["uniform", "softmax"])
def test_a_tiny_mass_shrinks_to_rank_1_which_is_casp_with_top_n_1(stats, weights):
    one = algo_config({**{**BASE, "loss.kind": "casp", "loss.top_n": 1, "loss.weights": weights}})
    tiny = replaced(one, {"loss.top_n": 4, "loss.candidates": "adaptive", "loss.candidate_mass": 1e-9})
    wide = replaced(one, {"loss.top_n": 4})
    fn, dtype = STATS[stats]
    for seed in range(3):
        problem = random_problem(900 + seed)
        loss_1, grad_1, _ = _loss_and_grad(problem, one, fn, dtype)
        loss_t, grad_t, metrics_t = _loss_and_grad(problem, tiny, fn, dtype)
        _, grad_w, _ = _loss_and_grad(problem, wide, fn, dtype)
        assert torch.equal(loss_t, loss_1)
        assert torch.equal(grad_t, grad_1)
        assert metrics_t["casp_candidates"] == 1.0
        assert not torch.allclose(grad_w, grad_1)  # the set matters on this problem


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        {"loss.weights": "softmax"},
        {"loss.candidate_mass": 0.8, "loss.top_n": 3},
        {"loss.agg": "seq_mean_token_mean", "loss.apply_to": "positive"},
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default",
)
def test_adaptive_matches_the_dense_oracle(variant):
    cfg = algo_config({**{**BASE, **ADAPTIVE, **variant}})
    sizes = []
    for seed in range(4):
        problem = random_problem(1000 + seed)
        loss, grad, metrics = _loss_and_grad(problem, cfg, dense_token_stats, torch.float64)
        logits = problem.logits.clone().requires_grad_(True)
        ref = reference_loss(logits, problem.targets, problem.old_logp, problem.advantages, problem.mask, cfg)
        (ref_grad,) = torch.autograd.grad(ref, logits)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
        stats = dense_token_stats(problem.logits, problem.targets, cfg.loss.top_n)
        sizes += [
            candidate_set_size(stats.topn_logp[b, t], cfg)
            for b in range(problem.mask.shape[0])
            for t in range(problem.mask.shape[1])
            if problem.mask[b, t]
        ]
    assert 1 in sizes and max(sizes) > 1, "the problems must exercise sets of different sizes"


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_adaptive_candidates_compose_with_every_loss(loss_name):
    """Only CaSP reads the set; every other loss runs, stays finite and is unchanged by the knob."""
    cfg = algo_config({**{**BASE, **ADAPTIVE, "loss.kind": loss_name}})
    problem = random_problem(1100)
    loss, grad, metrics = _loss_and_grad(problem, cfg, dense_token_stats, torch.float64)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    logits = problem.logits.clone().requires_grad_(True)
    ref = reference_loss(logits, problem.targets, problem.old_logp, problem.advantages, problem.mask, cfg)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logits)[0], rtol=1e-10, atol=1e-12)
    if loss_name != "casp":
        fixed_loss, fixed_grad, _ = _loss_and_grad(
            problem, replaced(cfg, {"loss.candidates": "fixed"}), dense_token_stats, torch.float64
        )
        assert torch.equal(loss, fixed_loss) and torch.equal(grad, fixed_grad)
        assert "casp_candidates" not in metrics and "casp_smoothed_tokens" not in metrics
    else:
        assert 1 <= metrics["casp_candidates"] <= cfg.loss.top_n
