"""Policy losses against the dense float64 oracle (statistics from full log_softmax), plus their invariants."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.algos import LOSS_NAMES, policy_loss
from megatron_rlvr.testing.configs import algo_config, replaced
from tests.support.algos.dense_reference import LOSS_COEFFICIENTS, dense_token_stats, random_problem, reference_loss

BASE = LOSS_COEFFICIENTS


def _grads(problem, cfg, *, with_ref=False, use_ids=True):
    logits = problem.logits.clone().requires_grad_(True)
    stats = dense_token_stats(logits, problem.targets, max(cfg.loss.top_n, 3))
    loss, metrics = policy_loss(
        stats,
        problem.old_logp,
        problem.advantages,
        problem.mask,
        cfg,
        ref_logp=problem.ref_logp if with_ref else None,
        target_ids=problem.targets if use_ids else None,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


def _reference_grads(problem, cfg, *, with_ref=False):
    logits = problem.logits.clone().requires_grad_(True)
    loss = reference_loss(
        logits,
        problem.targets,
        problem.old_logp,
        problem.advantages,
        problem.mask,
        cfg,
        ref_logp=problem.ref_logp if with_ref else None,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_gradient_matches_dense_reference(loss_name, loss_agg):
    for seed in range(3):
        problem = random_problem(seed)
        cfg = algo_config({"loss.kind": loss_name, "loss.agg": loss_agg, "loss.max_len_norm": 16, **BASE})
        loss, grad, _ = _grads(problem, cfg)
        ref_loss, ref_grad = _reference_grads(problem, cfg)
        assert grad.abs().max() > 1e-4, "the problem must exercise the loss"
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "variant",
    [
        {"loss.weights": "softmax"},
        {"loss.apply_to": "positive"},
        {"loss.apply_to": "negative"},
        {"loss.tau_q": 0.0},
        {"loss.top_n": 5},
        {"loss.top_n": 1},
        {"kl.coef": 0.2},
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_casp_variants_match_dense_reference(variant):
    cfg = algo_config({"loss.kind": "casp", **{**BASE, **variant}})
    for seed in range(3):
        problem = random_problem(100 + seed)
        with_ref = cfg.kl.coef > 0
        loss, grad, _ = _grads(problem, cfg, with_ref=with_ref)
        ref_loss, ref_grad = _reference_grads(problem, cfg, with_ref=with_ref)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)


def test_rank1_read_from_statistics_matches_ids():
    """Without target_ids, "y_t is rank 1" is read from logp == rank-1 log-prob; same result on generic data."""
    cfg = algo_config({"loss.kind": "casp", **BASE})
    problem = random_problem(7)
    _, with_ids, m1 = _grads(problem, cfg, use_ids=True)
    _, without_ids, m2 = _grads(problem, cfg, use_ids=False)
    assert torch.equal(with_ids, without_ids)
    assert m1["neg_rank1_frac"] == m2["neg_rank1_frac"] > 0


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_casp_without_its_terms_is_grpo_exactly(loss_agg):
    for seed in range(3):
        problem = random_problem(200 + seed)
        casp = algo_config(
            {"loss.kind": "casp", "loss.agg": loss_agg, **{**BASE, "loss.alpha": 0.0, "loss.lambda_top1": 0.0}}
        )
        grpo = replaced(casp, {"loss.kind": "grpo"})
        loss_c, grad_c, metrics_c = _grads(problem, casp)
        loss_g, grad_g, metrics_g = _grads(problem, grpo)
        assert torch.equal(grad_c, grad_g)
        assert torch.equal(loss_c, loss_g)
        assert metrics_c == metrics_g
        # ...and the CaSP terms do change the gradient on the same problem.
        _, grad_full, _ = _grads(problem, replaced(casp, {"loss.alpha": 0.3, "loss.lambda_top1": 0.5}))
        assert not torch.allclose(grad_full, grad_g)


def test_detached_weight_form_is_ppo_clip():
    """-w * logp with w = A * rho * keep (detached) has the gradient of -min(rho * A, clip(rho) * A)."""
    cfg = algo_config({"loss.kind": "grpo", "loss.eps_low": 0.2, "loss.eps_high": 0.28})
    for seed in range(5):
        problem = random_problem(300 + seed)
        loss, grad, metrics = _grads(problem, cfg)
        assert 0 < metrics["clip_frac"] < 1, "the problem must clip some tokens and not others"

        logits = problem.logits.clone().requires_grad_(True)
        logp = torch.log_softmax(logits, -1).gather(-1, problem.targets[..., None])[..., 0]
        rho = torch.exp(logp - problem.old_logp)
        adv = problem.advantages[:, None]
        surrogate = torch.minimum(rho * adv, rho.clamp(1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high) * adv)
        ppo = -(surrogate * problem.mask).sum() / problem.mask.sum()
        (ppo_grad,) = torch.autograd.grad(ppo, logits)
        torch.testing.assert_close(grad, ppo_grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(loss, ppo.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("loss_name", ["grpo", "casp", "entropy_bonus", "forking_tokens"])
def test_micro_batches_sum_to_the_mini_batch(loss_name, loss_agg):
    problem = random_problem(400)
    cfg = algo_config({"loss.kind": loss_name, "loss.agg": loss_agg, "kl.coef": 0.1, **BASE})
    logits = problem.logits.clone().requires_grad_(True)
    stats = dense_token_stats(logits, problem.targets, 3)
    whole, _ = policy_loss(stats, problem.old_logp, problem.advantages, problem.mask, cfg, ref_logp=problem.ref_logp)
    (whole_grad,) = torch.autograd.grad(whole, logits)

    num_tokens, num_seqs = float(problem.mask.sum()), float(problem.mask.any(-1).sum())
    total, split = 0.0, problem.logits.shape[0] // 2
    logits = problem.logits.clone().requires_grad_(True)
    for rows in (slice(0, split), slice(split, None)):
        stats = dense_token_stats(logits[rows], problem.targets[rows], 3)
        part, _ = policy_loss(
            stats,
            problem.old_logp[rows],
            problem.advantages[rows],
            problem.mask[rows],
            cfg,
            ref_logp=problem.ref_logp[rows],
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        total = total + part
    (split_grad,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total.detach(), whole.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-14)


def test_metrics_are_floats_over_response_tokens():
    problem = random_problem(500)
    _, _, metrics = _grads(problem, algo_config({"loss.kind": "casp", **BASE}), with_ref=True)
    expected = {
        "loss",
        "pg_loss",
        "clip_frac",
        "entropy",
        "entropy_high_entropy",
        "high_entropy_frac",
        "neg_rank1_frac",
        "kl_old",
        "kl_ref",
        "num_tokens",
    }
    expected |= {f"rank{k}_prob{s}" for k in (1, 2, 3) for s in ("", "_high_entropy")}
    assert set(metrics) == expected
    assert all(type(v) is float for v in metrics.values())
    mask = problem.mask
    stats = dense_token_stats(problem.logits, problem.targets, 3)
    assert metrics["num_tokens"] == float(mask.sum())
    assert metrics["entropy"] == pytest.approx(float(stats.entropy[mask].mean()))
    assert metrics["rank1_prob"] == pytest.approx(float(stats.topn_logp[..., 0].exp()[mask].mean()))
    assert metrics["rank1_prob"] > metrics["rank2_prob"] > metrics["rank3_prob"] > 0
    assert 0 < metrics["high_entropy_frac"] < 1
    negative = mask & (problem.advantages[:, None] < 0)
    assert metrics["neg_rank1_frac"] == pytest.approx(
        float((problem.targets == stats.topn_ids[..., 0])[negative].double().mean())
    )
    rho = torch.exp(stats.logp - problem.old_logp)[mask]
    assert metrics["kl_old"] == pytest.approx(float((rho - 1 - rho.log()).mean()))


def test_bad_inputs_are_named():
    problem = random_problem(600)
    stats = dense_token_stats(problem.logits, problem.targets, 3)
    cfg = algo_config({"loss.kind": "grpo"})
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(stats, problem.old_logp, problem.advantages[:-1], problem.mask, cfg)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(stats, problem.old_logp[:, :-1], problem.advantages, problem.mask, cfg)
    with pytest.raises(ValueError, match="top_n"):
        policy_loss(
            stats,
            problem.old_logp,
            problem.advantages,
            problem.mask,
            algo_config({"loss.kind": "casp", "loss.top_n": 4}),
        )
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(stats, problem.old_logp, problem.advantages, problem.mask, algo_config({"kl.coef": 0.1}))
    with pytest.raises(ValueError, match="algo.loss.kind"):
        algo_config({"loss.kind": "ppo"})
    with pytest.raises(ValueError, match="algo.loss.alpha"):
        algo_config({"loss.alpha": 1.5})


def test_an_overflowing_ratio_gives_finite_gradients():
    """rho = exp(logp - old_logp) = inf on a clipped or zero-advantage token must not turn the gradient into NaN."""
    problem = random_problem(700)
    problem.old_logp[0, 0] = -1e4  # A > 0 on row 0: clipped
    problem.old_logp[2, 0] = -1e4  # A = 0 on row 2
    for name in ("grpo", "casp", "psr"):
        loss, grad, metrics = _grads(problem, algo_config({"loss.kind": name, **BASE}))
        assert torch.isfinite(grad).all() and torch.isfinite(loss), name
        assert metrics["kl_old"] == float("inf"), "the ratio overflowed: the KL estimate says so instead of NaN"
