"""Every loss through the fused op (logits -> vocab_parallel_token_stats -> policy_loss -> backward) against the
dense float64 oracle, at TP = 1 in this process and TP = 2 on two gloo ranks with the vocabulary split between them;
also CaSP's adaptive candidate sets (decided from the op's gathered top-N) and PBA's per-sequence KL coefficient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlvr.algos import LOSS_NAMES, AlgoConfig, policy_loss
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.testing.configs import algo_config
from tests.support.algos.dense_reference import LOSS_COEFFICIENTS, random_problem, reference_loss, sequence_coefs

BASE = LOSS_COEFFICIENTS
CASES = [{"loss.kind": name} for name in LOSS_NAMES] + [
    {"loss.kind": "casp", "loss.agg": "seq_mean_token_mean", "loss.weights": "softmax"},
    {"loss.kind": "casp", "loss.agg": "seq_mean_token_sum_norm", "kl.coef": 0.2, "loss.top_n": 5},
    {"loss.kind": "grpo", "kl.coef": 0.2},
    {"loss.kind": "casp", "loss.candidates": "adaptive", "loss.candidate_mass": 0.5, "loss.top_n": 4},
    {
        "loss.kind": "casp",
        "loss.candidates": "adaptive",
        "loss.candidate_mass": 0.7,
        "loss.weights": "softmax",
        "loss.agg": "seq_mean_token_mean",
    },
    # "seq_kl": the KL coefficient per sequence (PBA), replacing algo.kl.coef
    {"loss.kind": "grpo", "kl.coef": 0.2, "seq_kl": True},
    {
        "loss.kind": "casp",
        "loss.candidates": "adaptive",
        "loss.candidate_mass": 0.5,
        "seq_kl": True,
        "loss.agg": "seq_mean_token_sum_norm",
    },
]
SEEDS = (11, 12)


def _cfg(case: dict) -> AlgoConfig:
    return algo_config({**{**BASE, "loss.max_len_norm": 16, **{k: v for k, v in case.items() if k != "seq_kl"}}})


def _kl_inputs(case: dict, cfg: AlgoConfig, problem, dtype: torch.dtype) -> dict:
    """policy_loss's ref_logp / kl_coef for the case (the oracle takes the same, in float64)."""
    if case.get("seq_kl"):
        return dict(ref_logp=problem.ref_logp.to(dtype), kl_coef=sequence_coefs(problem.mask.shape[0]).to(dtype))
    return dict(ref_logp=problem.ref_logp.to(dtype) if cfg.kl.coef > 0 else None)


def sharded_op_gradients(
    cases: list[dict], seeds: tuple[int, ...], dtype: torch.dtype
) -> list[tuple[float, torch.Tensor]]:
    """On each rank of the current group (or alone): this rank's vocab shard's loss value and logits gradient."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if tp > 1 else None
    out = []
    for case in cases:
        cfg = _cfg(case)
        for seed in seeds:
            problem = random_problem(seed, vocab_multiple=2)
            vocab = problem.logits.shape[-1]
            width = vocab // tp
            shard = problem.logits[..., rank * width : (rank + 1) * width].to(dtype).clone().requires_grad_(True)
            stats = vocab_parallel_token_stats(
                shard, problem.targets, max(cfg.loss.top_n, 3), group=group, vocab_start=rank * width, vocab_size=vocab
            )
            loss, _ = policy_loss(
                stats,
                problem.old_logp.to(dtype),
                problem.advantages.to(dtype),
                problem.mask,
                cfg,
                target_ids=problem.targets,
                **_kl_inputs(case, cfg, problem, dtype),
            )
            loss.backward()
            out.append((float(loss.detach()), shard.grad.detach().to(torch.float64)))
    return out


def _check_against_reference(per_rank: list[list[tuple[float, torch.Tensor]]], tol: dict) -> None:
    index = 0
    for case in CASES:
        cfg = _cfg(case)
        for seed in SEEDS:
            problem = random_problem(seed, vocab_multiple=2)
            logits = problem.logits.clone().requires_grad_(True)
            kl = _kl_inputs(case, cfg, problem, torch.float64)
            ref_loss = reference_loss(
                logits,
                problem.targets,
                problem.old_logp,
                problem.advantages,
                problem.mask,
                cfg,
                ref_logp=kl["ref_logp"],
                kl_coefs=kl.get("kl_coef"),
            )
            (ref_grad,) = torch.autograd.grad(ref_loss, logits)
            grad = torch.cat([rank_results[index][1] for rank_results in per_rank], dim=-1)
            for rank_results in per_rank:  # every TP rank computes the same loss
                assert rank_results[index][0] == pytest.approx(
                    float(ref_loss.detach()), rel=tol["rtol"], abs=tol["atol"]
                ), (case, seed)
            torch.testing.assert_close(grad, ref_grad, **tol, msg=lambda m: f"{case} seed {seed}: {m}")
            index += 1


FP64 = dict(rtol=1e-9, atol=1e-12)
FP32 = dict(rtol=2e-4, atol=2e-6)


def test_every_loss_through_the_op_tp1():
    _check_against_reference([sharded_op_gradients(CASES, SEEDS, torch.float64)], FP64)


def test_every_loss_through_the_op_tp1_fp32():
    _check_against_reference([sharded_op_gradients(CASES, SEEDS, torch.float32)], FP32)


@pytest.mark.dist
def test_every_loss_through_the_op_tp2(workers2):
    _check_against_reference(workers2.run(sharded_op_gradients, CASES, SEEDS, torch.float64), FP64)


@pytest.mark.dist
def test_every_loss_through_the_op_tp2_fp32(workers2):
    _check_against_reference(workers2.run(sharded_op_gradients, CASES, SEEDS, torch.float32), FP32)


def _assert_casp_without_terms_is_grpo(per_rank: list[list[tuple[float, torch.Tensor]]]) -> None:
    for results in per_rank:
        half = len(results) // 2
        for (loss_g, grad_g), (loss_c, grad_c) in zip(results[:half], results[half:]):
            assert loss_g == loss_c
            assert torch.equal(grad_g, grad_c)


ZERO_CASP = [{"loss.kind": "grpo"}, {"loss.kind": "casp", "loss.alpha": 0.0, "loss.lambda_top1": 0.0}]


def test_casp_without_its_terms_is_grpo_through_the_op_tp1():
    _assert_casp_without_terms_is_grpo([sharded_op_gradients(ZERO_CASP, SEEDS, torch.float32)])


@pytest.mark.dist
def test_casp_without_its_terms_is_grpo_through_the_op_tp2(workers2):
    _assert_casp_without_terms_is_grpo(workers2.run(sharded_op_gradients, ZERO_CASP, SEEDS, torch.float32))
