"""ARMOR's mixed ratio (algos/mixed_ratio.py) in every loss: a = 1 is the plain loss bit for bit, the loss and its
gradient equal a dense float64 formula written in probability space, and TP = 2 equals TP = 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_rlvr.algos import LOSS_NAMES, AlgoConfig, policy_loss
from megatron_rlvr.algos.mixed_ratio import mixed_log_probs, on_policy_share
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.testing.configs import algo_config
from tests.support.algos.dense_reference import LOSS_COEFFICIENTS, dense_token_stats, random_problem

BASE = LOSS_COEFFICIENTS
SEEDS = (21, 22)


def _loss_and_grad(problem, cfg: AlgoConfig):
    logits = problem.logits.clone().requires_grad_(True)
    stats = dense_token_stats(logits, problem.targets, max(cfg.loss.top_n, 3))
    loss, _ = policy_loss(
        stats,
        problem.old_logp,
        problem.advantages,
        problem.mask,
        cfg,
        ref_logp=problem.ref_logp,
        target_ids=problem.targets,
        mixed_ratio_share=cfg.armor.mixed_ratio_share,  # given explicitly: AlgoConfig.mixed_ratio_share's own
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_share_one_is_the_plain_loss_bit_for_bit(loss_name, loss_agg):
    for seed in SEEDS:
        problem = random_problem(seed)
        plain = algo_config({**BASE, "loss.kind": loss_name, "loss.agg": loss_agg})
        mixed = algo_config({**BASE, "loss.kind": loss_name, "loss.agg": loss_agg, "armor.mixed_ratio_share": 1.0})
        (loss_p, grad_p), (loss_m, grad_m) = _loss_and_grad(problem, plain), _loss_and_grad(problem, mixed)
        assert torch.equal(loss_p, loss_m), (loss_name, seed)
        assert torch.equal(grad_p, grad_m), (loss_name, seed)


def test_mixed_log_probs_at_share_one_are_the_inputs():
    problem = random_problem(3)
    logp = problem.old_logp.clone().requires_grad_(True)
    policy, behaviour = mixed_log_probs(logp, problem.old_logp, problem.ref_logp, 1.0)
    assert torch.equal(policy, logp) and torch.equal(behaviour, problem.old_logp)
    (grad,) = torch.autograd.grad(policy.sum(), logp)
    assert torch.equal(grad, torch.ones_like(grad))


def dense_mixed_loss(logits, problem, cfg: AlgoConfig, share: float) -> torch.Tensor:
    """DAPO's token-mean clipped surrogate with r_mix written in probability space, token by token, differentiated
    by autograd (GRPO's shaping: no multiplier, no smoothing, no KL; the paper's loss)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    b, t = problem.mask.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            if not problem.mask[i, j] or problem.advantages[i] == 0:
                continue
            pi = logprobs[i, j, problem.targets[i, j]].exp()
            old = math.exp(float(problem.old_logp[i, j]))
            ref = math.exp(float(problem.ref_logp[i, j]))
            r = (share * pi + (1 - share) * ref) / (share * old + (1 - share) * ref)
            a = float(problem.advantages[i])
            clipped = r.clamp(1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high)
            total = total - torch.minimum(r * a, clipped * a)
    return total / float(problem.mask.sum())


@pytest.mark.parametrize("share", [0.9375, 0.5, 0.2])
def test_mixed_ratio_matches_the_dense_formula(share):
    for seed in SEEDS:
        problem = random_problem(seed)
        cfg = algo_config({"loss.kind": "grpo", "armor.mixed_ratio_share": share})
        loss, grad = _loss_and_grad(problem, cfg)
        logits = problem.logits.clone().requires_grad_(True)
        ref_loss = dense_mixed_loss(logits, problem, cfg, share)
        (ref_grad,) = torch.autograd.grad(ref_loss, logits)
        assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
        assert not torch.equal(
            grad, _loss_and_grad(problem, algo_config({"loss.kind": "grpo"}))[1]
        )  # the mixing is visible


def test_mixed_ratio_needs_the_reference_and_a_share():
    problem = random_problem(5)
    stats = dense_token_stats(problem.logits, problem.targets, 3)
    cfg = algo_config({"loss.kind": "grpo", "armor.mixed_ratio_share": 0.5})
    with pytest.raises(ValueError, match=r"^ref_logp: ARMOR's mixed ratio \(a = 0.5\) needs the reference"):
        policy_loss(stats, problem.old_logp, problem.advantages, problem.mask, cfg, mixed_ratio_share=0.5)
    with pytest.raises(ValueError, match=r"^mixed_ratio_share: expected a share \(AlgoConfig.mixed_ratio_share\)"):
        policy_loss(stats, problem.old_logp, problem.advantages, problem.mask, cfg, ref_logp=problem.ref_logp)
    with pytest.raises(ValueError, match=r"^algo.armor.mixed_ratio_share: expected in \(0, 1\], got 0.0"):
        algo_config({"armor.mixed_ratio_share": 0.0})
    # ARMOR's anchors without an explicit share: the on-policy share of the run's groups
    assert algo_config({"armor.anchors": True}).mixed_ratio_share(16) == on_policy_share(16)
    assert algo_config({"armor.mixed_ratio_share": 0.5}).mixed_ratio_share(16) == 0.5
    assert algo_config().mixed_ratio_share(16) is None
    assert on_policy_share(16) == 0.9375
    with pytest.raises(ValueError, match="group_size: expected more than 1"):
        on_policy_share(1)


CASES = [{"loss.kind": name} for name in LOSS_NAMES]


def sharded_mixed_gradients(cases: list[dict], share: float) -> list[tuple[float, torch.Tensor]]:
    """On each rank of the current group (or alone): the loss and this rank's vocab shard's logits gradient."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for case in cases:
        cfg = algo_config({**{**BASE, **case, "armor.mixed_ratio_share": share}})
        problem = random_problem(SEEDS[0], vocab_multiple=2)
        width = problem.logits.shape[-1] // tp
        shard = problem.logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        stats = vocab_parallel_token_stats(
            shard,
            problem.targets,
            max(cfg.loss.top_n, 3),
            group=dist.group.WORLD if tp > 1 else None,
            vocab_start=rank * width,
            vocab_size=problem.logits.shape[-1],
        )
        loss, _ = policy_loss(
            stats,
            problem.old_logp,
            problem.advantages,
            problem.mask,
            cfg,
            ref_logp=problem.ref_logp,
            target_ids=problem.targets,
            mixed_ratio_share=cfg.armor.mixed_ratio_share,
        )
        loss.backward()
        out.append((float(loss.detach()), shard.grad.detach()))
    return out


@pytest.mark.dist
def test_tp2_equals_tp1(workers2):
    share = 0.75
    single = sharded_mixed_gradients(CASES, share)
    per_rank = workers2.run(sharded_mixed_gradients, CASES, share)
    for index, (loss, grad) in enumerate(single):
        for rank_results in per_rank:
            assert rank_results[index][0] == pytest.approx(loss, rel=1e-6, abs=1e-9), CASES[index]
        joined = torch.cat([rank_results[index][1] for rank_results in per_rank], dim=-1)
        torch.testing.assert_close(joined, grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"{CASES[index]}: {m}")
