"""PBA (docs/algorithms.md, "PBA"): the split of prompts by base evidence, the per-response KL coefficient, and the
loss's k3 KL term with a per-sequence coefficient, by hand in float64 and against the dense oracle for every loss.
The op at TP = 1 / 2 is in test_losses_op.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.algos import LOSS_NAMES, pba_metrics, policy_loss, sequence_kl_coef
from megatron_rlvr.algos.pba import risky_prompts
from megatron_rlvr.testing.configs import algo_config, replaced
from tests.support.algos.dense_reference import (
    LOSS_COEFFICIENTS,
    dense_token_stats,
    random_problem,
    reference_loss,
    sequence_coefs,
)

BASE = LOSS_COEFFICIENTS
PBA = {"kl.pba.enabled": True, "kl.pba.base_samples": 8, "kl.pba.min_correct": 2, "kl.pba.coef": 0.25}


def test_split_and_coefficients_by_hand():
    cfg = algo_config({**PBA, "kl.coef": 0.0})
    base_correct = torch.tensor([0, 1, 2, 8, 5])
    assert risky_prompts(base_correct, cfg).tolist() == [True, True, False, False, False]  # c_b < m_min
    coef = sequence_kl_coef(base_correct, 3, cfg)
    assert coef.dtype == torch.float32
    assert coef.tolist() == [0.25] * 6 + [0.0] * 9  # each prompt's group contiguous, as compute_advantages
    with_global = sequence_kl_coef(base_correct, 2, replaced(cfg, {"kl.coef": 0.01}))
    assert with_global.tolist() == pytest.approx([0.25] * 4 + [0.01] * 6, rel=1e-7)  # sharpened prompts keep kl_coef
    assert pba_metrics(base_correct, cfg) == pytest.approx(
        {"pba/anchored_frac": 2 / 5, "pba/base_pass_rate": (0 + 1 + 2 + 8 + 5) / (5 * 8)}
    )
    # m_min = 0: no prompt is risky; m_min = M: all but the always-solved ones are
    assert not risky_prompts(base_correct, replaced(cfg, {"kl.pba.min_correct": 0})).any()
    assert risky_prompts(base_correct, replaced(cfg, {"kl.pba.min_correct": 8})).tolist() == [1, 1, 1, 0, 1]


def test_bad_evidence_is_named():
    cfg = algo_config({**PBA})
    for bad in (torch.tensor([0, 9]), torch.tensor([-1]), torch.tensor([0.5]), torch.tensor([[1]])):
        with pytest.raises(ValueError, match="base_correct"):
            sequence_kl_coef(bad, 2, cfg)
    with pytest.raises(ValueError, match="group_size"):
        sequence_kl_coef(torch.tensor([1]), 0, cfg)
    problem = random_problem(1)
    stats = dense_token_stats(problem.logits, problem.targets, 3)
    args = (stats, problem.old_logp, problem.advantages, problem.mask, algo_config({"loss.kind": "grpo"}))
    b = problem.mask.shape[0]
    with pytest.raises(ValueError, match="kl_coef: expected shape"):
        policy_loss(*args, ref_logp=problem.ref_logp, kl_coef=torch.zeros(b + 1))
    with pytest.raises(ValueError, match="kl_coef: expected finite"):
        policy_loss(*args, ref_logp=problem.ref_logp, kl_coef=torch.full((b,), -0.1))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(*args, kl_coef=torch.full((b,), 0.1))
    policy_loss(*args, kl_coef=torch.zeros(b))  # no coefficient > 0: no reference needed


def test_per_prompt_kl_term_by_hand():
    """Zero advantages leave only the KL term: (1 / tokens) sum_t c_b(t) * (exp(d) - d - 1), d = ref - logp, and its
    gradient sum_t c_b(t) * (1 - exp(d)) * (e_y - p) / tokens, written out in float64."""
    cfg = algo_config({**PBA, "loss.kind": "grpo"})
    base_correct = torch.tensor([0, 6])  # prompt 0 risky, prompt 1 sharpened; G = 2
    coef = sequence_kl_coef(base_correct, 2, cfg)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 6, (4, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    ref_logp = logp + 0.4 * torch.randn(4, 3, generator=g, dtype=torch.float64)
    leaf = logits.clone().requires_grad_(True)
    stats = dense_token_stats(leaf, targets, 3)
    loss, metrics = policy_loss(
        stats, stats.logp.detach(), torch.zeros(4, dtype=torch.float64), mask, cfg, ref_logp=ref_logp, kl_coef=coef
    )
    loss.backward()

    tokens = int(mask.sum())
    value, kl, grad = 0.0, 0.0, torch.zeros_like(logits)
    for b in range(4):
        for t in range(3):
            if not mask[b, t]:
                continue
            p = [math.exp(x) for x in torch.log_softmax(logits[b, t], -1).tolist()]
            d = float(ref_logp[b, t]) - math.log(p[int(targets[b, t])])
            c = 0.25 if b < 2 else 0.0
            value += c * (math.exp(d) - d - 1) / tokens
            kl += (math.exp(d) - d - 1) / tokens
            for v in range(6):
                grad[b, t, v] = c * (1 - math.exp(d)) * ((v == int(targets[b, t])) - p[v]) / tokens
    assert float(loss.detach()) == pytest.approx(value, rel=1e-12)
    assert metrics["kl_loss"] == pytest.approx(value, rel=1e-12) and metrics["kl_ref"] == pytest.approx(kl, rel=1e-12)
    torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-14)
    assert leaf.grad[2:].abs().max() == 0 < leaf.grad[:2].abs().max()  # the sharpened prompt: no KL gradient


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_per_sequence_kl_composes_with_every_loss(loss_name, loss_agg):
    cfg = algo_config(
        {**{**BASE, "loss.kind": loss_name, "loss.agg": loss_agg, "loss.max_len_norm": 16, "kl.coef": 0.7}}
    )
    for seed in range(2):
        problem = random_problem(1200 + seed)
        coefs = sequence_coefs(problem.mask.shape[0])

        def run(**kwargs):
            logits = problem.logits.clone().requires_grad_(True)
            stats = dense_token_stats(logits, problem.targets, 3)
            loss, metrics = policy_loss(
                stats, problem.old_logp, problem.advantages, problem.mask, cfg, target_ids=problem.targets, **kwargs
            )
            return loss.detach(), torch.autograd.grad(loss, logits)[0], metrics

        loss, grad, metrics = run(ref_logp=problem.ref_logp, kl_coef=coefs)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        logits = problem.logits.clone().requires_grad_(True)
        ref = reference_loss(
            logits,
            problem.targets,
            problem.old_logp,
            problem.advantages,
            problem.mask,
            cfg,
            ref_logp=problem.ref_logp,
            kl_coefs=coefs,
        )
        torch.testing.assert_close(grad, torch.autograd.grad(ref, logits)[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
        assert metrics["kl_loss"] > 0
        # coefficient 0 for every sequence is no KL at all (algo.kl.coef = 0.7 is replaced, not added), bit for bit
        zero_loss, zero_grad, zero_metrics = run(ref_logp=problem.ref_logp, kl_coef=torch.zeros(len(coefs)))
        _, global_grad, _ = run(ref_logp=problem.ref_logp)
        no_kl = replaced(cfg, {"kl.coef": 0.0})
        base_logits = problem.logits.clone().requires_grad_(True)
        stats = dense_token_stats(base_logits, problem.targets, 3)
        base, _ = policy_loss(
            stats, problem.old_logp, problem.advantages, problem.mask, no_kl, target_ids=problem.targets
        )
        base_grad = torch.autograd.grad(base, base_logits)[0]
        assert torch.equal(zero_loss, base.detach()) and torch.equal(zero_grad, base_grad)
        assert zero_metrics["kl_loss"] == 0.0
        assert zero_metrics["kl_ref"] == metrics["kl_ref"] > 0  # the estimate is still reported
        assert not torch.equal(global_grad, base_grad)  # without per-sequence coefficients algo.kl.coef applies
