"""Rollout correction (tis, mis, icepop at token and sequence level): a 5-token case worked by hand in float64, the
dense oracle for every loss, the identity when the engine agrees with the actor, and the edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.algos import LOSS_NAMES, AlgoConfig, policy_loss
from megatron_rlvr.algos.rollout_correction import correction_weights
from megatron_rlvr.testing.configs import algo_config, replaced
from tests.support.algos.dense_reference import (
    LOSS_COEFFICIENTS,
    DenseStats,
    dense_token_stats,
    random_problem,
    reference_loss,
)

CORRECTIONS = ("tis", "mis", "icepop")
LEVELS = ("token", "sequence")
BASE = LOSS_COEFFICIENTS

# Two responses, 5 tokens: rho = exp(old_logp - engine_logp) is 0.4, 0.9, 3.0 on the first, 1.5, 3.0 on the second
# (its third position is padding). Thresholds are the defaults: C = 2, band [0.5, 2].
RHO = [[0.4, 0.9, 3.0], [1.5, 3.0, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.3, -0.7]], dtype=torch.float64)
ENGINE = OLD - torch.tensor(RHO, dtype=torch.float64).log()
G0 = (0.4 * 0.9 * 3.0) ** (1 / 3)  # geometric means of rho per response: 1.026 (inside the band), 2.121 (outside)
G1 = (1.5 * 3.0) ** (1 / 2)
HAND = {  # (c per token, padding 1; weight mean over the 5 tokens; truncated or masked fraction)
    ("tis", "token"): ([[0.4, 0.9, 2.0], [1.5, 2.0, 1.0]], (0.4 + 0.9 + 2.0 + 1.5 + 2.0) / 5, 2 / 5),
    ("icepop", "token"): ([[0.0, 0.9, 0.0], [1.5, 0.0, 1.0]], (0.9 + 1.5) / 5, 3 / 5),
    ("mis", "token"): ([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]], 2 / 5, 3 / 5),
    # the product 1.08 stays under C; 4.5 is truncated to 2
    ("tis", "sequence"): ([[1.08, 1.08, 1.08], [2.0, 2.0, 1.0]], (3 * 1.08 + 2 * 2.0) / 5, 2 / 5),
    ("icepop", "sequence"): ([[G0, G0, G0], [0.0, 0.0, 1.0]], 3 * G0 / 5, 2 / 5),
    ("mis", "sequence"): ([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]], 3 / 5, 2 / 5),
}


def _cfg(kind: str, level: str, settings: dict | None = None) -> AlgoConfig:
    return algo_config({"rollout_correction.kind": kind, "rollout_correction.level": level, **(settings or {})})


@pytest.mark.parametrize("kind,level", list(HAND))
def test_correction_weights_by_hand(kind, level):
    weights, metrics = correction_weights(OLD, ENGINE, MASK, _cfg(kind, level))
    expected, mean, dropped = HAND[kind, level]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    dropped_key = "clipped_frac" if kind == "tis" else "masked_frac"
    assert set(metrics) == {"rollout_correction/weight_mean", f"rollout_correction/{dropped_key}"}
    assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx(mean, rel=1e-12)
    assert float(metrics[f"rollout_correction/{dropped_key}"]) == pytest.approx(dropped, rel=1e-12)


def _leaf_stats(logp: torch.Tensor) -> DenseStats:
    """Statistics around a leaf log-prob tensor: the GRPO loss reads only logp (the rest feeds the metrics)."""
    ranks = torch.stack([logp.detach(), logp.detach() - 1, logp.detach() - 2], dim=-1)
    return DenseStats(logp, torch.zeros_like(logp), ranks, torch.zeros(ranks.shape, dtype=torch.long))


@pytest.mark.parametrize("kind,level", list(HAND))
def test_loss_and_gradient_by_hand(kind, level):
    """GRPO, token_mean, inside the clip range: loss = -1/5 sum c_t A rho_t, d loss / d logp_t = -c_t A rho_t / 5."""
    delta = torch.tensor([[0.05, -0.1, 0.02], [0.1, -0.05, 0.0]], dtype=torch.float64)  # logp - old_logp
    advantages = torch.tensor([1.5, -0.7], dtype=torch.float64)
    logp = (OLD + delta).requires_grad_(True)
    loss, metrics = policy_loss(
        _leaf_stats(logp), OLD, advantages, MASK, _cfg(kind, level, {"loss.kind": "grpo"}), rollout_logp=ENGINE
    )
    (grad,) = torch.autograd.grad(loss, logp)
    c = HAND[kind, level][0]
    want_grad = [[0.0] * 3 for _ in range(2)]
    want_loss = 0.0
    for b, t in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1)):
        term = c[b][t] * float(advantages[b]) * math.exp(float(delta[b, t]))
        want_grad[b][t] = -term / 5
        want_loss -= term / 5
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-12)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(HAND[kind, level][1], rel=1e-12)


def _grads(problem, cfg, rollout_logp, old_logp="problem"):
    logits = problem.logits.clone().requires_grad_(True)
    stats = dense_token_stats(logits, problem.targets, max(cfg.loss.top_n, 3))
    old = problem.old_logp if old_logp == "problem" else old_logp
    loss, metrics = policy_loss(
        stats,
        old,
        problem.advantages,
        problem.mask,
        cfg,
        ref_logp=problem.ref_logp,
        rollout_logp=rollout_logp,
        target_ids=problem.targets,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


def _engine_logp(problem, seed: int) -> torch.Tensor:
    """The engine's log-probs: the actor's perturbed enough that some ratios leave [0.5, 2] and exceed C = 2."""
    g = torch.Generator().manual_seed(seed)
    return problem.old_logp + 0.6 * torch.randn(problem.old_logp.shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", CORRECTIONS)
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_every_loss_matches_the_dense_reference(loss_name, kind, level):
    changed = []
    for seed in range(3):
        problem = random_problem(800 + seed)
        engine = _engine_logp(problem, seed)
        cfg = _cfg(kind, level, {"loss.kind": loss_name, "kl.coef": 0.1, **BASE})
        loss, grad, metrics = _grads(problem, cfg, engine)
        logits = problem.logits.clone().requires_grad_(True)
        ref = reference_loss(
            logits,
            problem.targets,
            problem.old_logp,
            problem.advantages,
            problem.mask,
            cfg,
            ref_logp=problem.ref_logp,
            rollout_logp=engine,
        )
        (ref_grad,) = torch.autograd.grad(ref, logits)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
        _, plain_grad, _ = _grads(problem, replaced(cfg, {"rollout_correction.kind": "none"}), None)
        changed.append(not torch.allclose(grad, plain_grad))
        assert metrics["rollout_correction/weight_mean"] > 0
    assert any(changed), "the correction must change these problems' gradients"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", CORRECTIONS)
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_engine_equal_to_actor_is_the_identity_bit_for_bit(loss_name, kind, level):
    problem = random_problem(900)
    cfg = _cfg(kind, level, {"loss.kind": loss_name, "kl.coef": 0.1, **BASE})
    plain_loss, plain_grad, plain_metrics = _grads(problem, replaced(cfg, {"rollout_correction.kind": "none"}), None)
    loss, grad, metrics = _grads(problem, cfg, problem.old_logp.clone())
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert metrics["rollout_correction/weight_mean"] == 1.0
    assert metrics.pop("rollout_correction/clipped_frac", None) in (0.0, None)
    assert metrics.pop("rollout_correction/masked_frac", None) in (0.0, None)
    metrics.pop("rollout_correction/weight_mean")
    assert metrics == plain_metrics


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", CORRECTIONS)
def test_old_logp_none_is_on_policy_with_every_correction(kind, level):
    """old_logp=None (the statistics pass skipped) means the detached current log-probs, corrections included."""
    problem = random_problem(950)
    with torch.no_grad():
        logp = dense_token_stats(problem.logits, problem.targets, 3).logp
    engine = _engine_logp(problem, 3)
    cfg = _cfg(kind, level, {"loss.kind": "casp", **BASE})
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _grads(problem, cfg, engine, old_logp=None)[:2], _grads(problem, cfg, engine, old_logp=logp.clone())[:2]
        )
    )
    # and with the engine equal to the actor it is the identity there too
    none = replaced(cfg, {"rollout_correction.kind": "none"})
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _grads(problem, cfg, logp.clone(), old_logp=None)[:2], _grads(problem, none, None, old_logp=None)[:2]
        )
    )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", CORRECTIONS)
def test_an_overflowing_ratio_is_truncated_or_masked_never_nan(kind, level):
    problem = random_problem(960)
    engine = problem.old_logp.clone()
    engine[0, 0] = -1e4  # rho = exp(1e4) = inf on a response token of row 0 (A > 0)
    loss, grad, metrics = _grads(problem, _cfg(kind, level, {"loss.kind": "grpo"}), engine)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    weights, _ = correction_weights(problem.old_logp, engine, problem.mask, _cfg(kind, level))
    expected = 2.0 if kind == "tis" else 0.0  # truncated to C, or outside the band
    assert float(weights[0, 0]) == expected
    if level == "sequence":
        assert (weights[0][problem.mask[0]] == expected).all()


def test_bad_inputs_are_named():
    problem = random_problem(970)
    stats = dense_token_stats(problem.logits, problem.targets, 3)
    cfg = _cfg("tis", "token", {"loss.kind": "grpo"})
    with pytest.raises(ValueError, match="rollout_logp.*algo.rollout_correction.kind = 'tis'"):
        policy_loss(stats, problem.old_logp, problem.advantages, problem.mask, cfg)
    with pytest.raises(ValueError, match="rollout_logp: expected shape"):
        policy_loss(
            stats, problem.old_logp, problem.advantages, problem.mask, cfg, rollout_logp=problem.old_logp[:, :-1]
        )
    for key, value in (
        ("rollout_correction.kind", "is"),
        ("rollout_correction.level", "batch"),
        ("rollout_correction.cap", 0.5),
        ("rollout_correction.low", 1.5),
        ("rollout_correction.high", 0.9),
    ):
        with pytest.raises(ValueError, match=f"algo.{key}"):
            algo_config({key: value})
