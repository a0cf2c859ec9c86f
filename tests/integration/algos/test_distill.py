"""On-policy distillation's two signals (algos/distill.py) through the fused op and ops.given_ids: hand-worked
float64 cases on 5 tokens, a teacher equal to the student giving exactly zero, every loss against the dense float64
oracle at TP = 1 and TP = 2 (vocabulary split over two gloo ranks), distill_coef = 0 bit-equal to the RL loss alone,
and the one-line errors of bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_rlvr.algos import LOSS_NAMES, AlgoConfig, policy_loss
from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.ops.given_ids import logits_at_ids
from megatron_rlvr.testing.configs import algo_config, run_config
from tests.support.algos.dense_reference import LOSS_COEFFICIENTS, random_problem, reference_loss

BASE = {
    **LOSS_COEFFICIENTS,
    "loss.max_len_norm": 16,
    "distill.kind": "teacher",
    "distill.teacher_hf_dir": "teacher",
    "distill.coef": 0.7,
    "distill.top_n": 3,
}


def _cfg(overrides: dict | None = None) -> AlgoConfig:
    return algo_config({**BASE, **(overrides or {})})


def _shard(logits: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    width = logits.shape[-1] // tp
    return logits[..., rank * width : (rank + 1) * width]


def op_loss(
    student,
    teacher_logits,
    targets,
    mask,
    advantages,
    cfg,
    *,
    old_logp=None,
    ref_logp=None,
    rollout_logp=None,
    temperature=1.0,
    with_teacher=True,
    dtype=torch.float64,
):
    """This rank's (loss, metrics, logits-shard gradient): the teacher scored by the op and ops.given_ids on its
    shard, the student's logits at the teacher's ids routed beside the op, then policy_loss and backward."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if tp > 1 else None
    vocab = student.shape[-1]
    start = rank * (vocab // tp)
    shard = _shard(student, rank, tp).to(dtype).clone().requires_grad_(True)
    teacher, student_at, logits = None, None, shard
    if with_teacher:
        t_shard = _shard(teacher_logits, rank, tp).to(dtype)
        t_stats = vocab_parallel_token_stats(
            t_shard,
            targets,
            cfg.distill.top_n,
            group=group,
            vocab_start=start,
            vocab_size=vocab,
            temperature=temperature,
        )
        _, t_at = logits_at_ids(t_shard, t_stats.topn_ids, vocab_start=start, temperature=temperature, group=group)
        teacher = TeacherScores(t_stats.logp, t_stats.topn_ids, t_at)
        logits, student_at = logits_at_ids(
            shard, t_stats.topn_ids, vocab_start=start, temperature=temperature, group=group
        )
    stats = vocab_parallel_token_stats(
        logits,
        targets,
        max(cfg.loss.top_n, 3),
        group=group,
        vocab_start=start,
        vocab_size=vocab,
        temperature=temperature,
        inplace_backward=True,
    )
    loss, metrics = policy_loss(
        stats,
        None if old_logp is None else old_logp.to(dtype),
        advantages.to(dtype),
        mask,
        cfg,
        ref_logp=None if ref_logp is None else ref_logp.to(dtype),
        rollout_logp=None if rollout_logp is None else rollout_logp.to(dtype),
        target_ids=targets,
        teacher=teacher,
        student_at_teacher_ids=student_at,
    )
    loss.backward()
    return loss.detach(), metrics, shard.grad.detach()


# ---------------------------------------------------------------------------------------------------------------
# By hand: 5 tokens, vocabulary of 4, float64


STUDENT = [
    [2.0, 1.0, 0.0, -1.0],
    [0.5, 0.5, 1.5, 0.0],
    [-1.0, 0.0, 1.0, 2.0],
    [1.0, 3.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 1.0],
]
TEACHER = [
    [1.0, 2.0, 0.0, 0.0],
    [0.0, 1.0, 2.0, -1.0],
    [0.0, 0.0, 3.0, 1.0],
    [2.0, 2.0, 0.0, -2.0],
    [1.0, -1.0, 0.5, 0.0],
]
SAMPLED = [0, 2, 3, 1, 3]


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


def _hand_reverse() -> tuple[float, list[list[float]]]:
    """value = mean_t (logp_s - logp_T) (rho = 1: -A_t averaged); d/dz_s[t, j] = -(1/5) A_t ([j = y] - p_j)."""
    value, grad = 0.0, []
    for z_s, z_t, y in zip(STUDENT, TEACHER, SAMPLED):
        ls, lt = _log_softmax(z_s), _log_softmax(z_t)
        a = -(ls[y] - lt[y])
        value += -a / 5
        grad.append([-(a / 5) * ((1.0 if j == y else 0.0) - math.exp(ls[j])) for j in range(4)])
    return value, grad


def _hand_forward(n: int) -> tuple[float, list[list[float]]]:
    """S = the teacher's top-n ids (ties to the lower id); q, p~ renormalised over S; value = mean_t KL(q || p~);
    d/dz_s[t, j] = (1/5) (p~_j - q_j) for j in S, 0 elsewhere."""
    value, grad = 0.0, []
    for z_s, z_t in zip(STUDENT, TEACHER):
        ids = sorted(range(4), key=lambda j: (-z_t[j], j))[:n]
        lq, lp = _log_softmax([z_t[j] for j in ids]), _log_softmax([z_s[j] for j in ids])
        value += sum(math.exp(a) * (a - b) for a, b in zip(lq, lp)) / 5
        row = [0.0] * 4
        for j, a, b in zip(ids, lq, lp):
            row[j] = (math.exp(b) - math.exp(a)) / 5
        grad.append(row)
    return value, grad


@pytest.mark.parametrize("signal", ["reverse_kl_sampled", "topn_forward_kl", "both"])
def test_hand_worked_five_tokens(signal):
    cfg = _cfg(
        {"loss.kind": "grpo", "distill.only": True, "distill.coef": 1.0, "distill.signal": signal, "distill.top_n": 2}
    )
    student, teacher = torch.tensor([STUDENT], dtype=torch.float64), torch.tensor([TEACHER], dtype=torch.float64)
    loss, metrics, grad = op_loss(
        student, teacher, torch.tensor([SAMPLED]), torch.ones(1, 5, dtype=torch.bool), torch.tensor([1.0]), cfg
    )
    rev_value, rev_grad = _hand_reverse()
    fwd_value, fwd_grad = _hand_forward(2)
    value = (rev_value if signal != "topn_forward_kl" else 0.0) + (fwd_value if signal != "reverse_kl_sampled" else 0.0)
    expected = [
        [
            (r if signal != "topn_forward_kl" else 0.0) + (f if signal != "reverse_kl_sampled" else 0.0)
            for r, f in zip(rr, fr)
        ]
        for rr, fr in zip(rev_grad, fwd_grad)
    ]
    assert float(loss) == pytest.approx(value, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    # the metrics hold both signals whichever trains: the sampled reverse KL and the top-N forward KL
    assert metrics["distill/reverse_kl"] == pytest.approx(rev_value, rel=1e-12)
    assert metrics["distill/forward_kl_topn"] == pytest.approx(fwd_value, rel=1e-12)
    teacher_logp = sum(_log_softmax(z)[y] for z, y in zip(TEACHER, SAMPLED)) / 5
    assert metrics["distill/teacher_logp"] == pytest.approx(teacher_logp, rel=1e-12)
    agree = (
        sum(
            max(range(4), key=lambda j: (s[j], -j)) == max(range(4), key=lambda j: (t[j], -j))
            for s, t in zip(STUDENT, TEACHER)
        )
        / 5
    )
    assert metrics["distill/top1_agreement"] == agree


# ---------------------------------------------------------------------------------------------------------------
# Teacher = student: exactly zero


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_equal_to_student_gives_exactly_zero(dtype, temperature):
    problem = random_problem(5)
    mask = problem.mask
    cfg = _cfg(
        {"loss.kind": "grpo", "distill.only": True, "distill.coef": 1.0, "distill.signal": "both", "distill.top_n": 4}
    )
    loss, metrics, grad = op_loss(
        problem.logits,
        problem.logits,
        problem.targets,
        mask,
        problem.advantages,
        cfg,
        temperature=temperature,
        dtype=dtype,
    )
    assert float(loss) == 0.0 and metrics["distill/reverse_kl"] == 0.0 and metrics["distill/forward_kl_topn"] == 0.0
    assert int(torch.count_nonzero(grad)) == 0
    assert metrics["distill/top1_agreement"] == 1.0
    # with the RL term on, the distillation adds nothing at all: the loss and gradient of RL alone, bit for bit
    for name in ("grpo", "casp"):
        with_teacher = op_loss(
            problem.logits,
            problem.logits,
            problem.targets,
            mask,
            problem.advantages,
            _cfg({"loss.kind": name, "distill.coef": 1.0}),
            temperature=temperature,
            dtype=dtype,
        )
        alone = op_loss(
            problem.logits,
            None,
            problem.targets,
            mask,
            problem.advantages,
            _cfg({"loss.kind": name, "distill.kind": "none"}),
            temperature=temperature,
            dtype=dtype,
            with_teacher=False,
        )
        assert torch.equal(with_teacher[0], alone[0]) and torch.equal(with_teacher[2], alone[2]), name


# ---------------------------------------------------------------------------------------------------------------
# Every loss against the dense oracle, TP = 1 and TP = 2


CASES = [{"loss.kind": name} for name in LOSS_NAMES] + [
    {"loss.kind": "casp", "distill.signal": "reverse_kl_sampled", "loss.agg": "seq_mean_token_mean"},
    {"loss.kind": "grpo", "distill.signal": "topn_forward_kl", "loss.agg": "seq_mean_token_sum_norm", "kl.coef": 0.2},
    {"loss.kind": "casp", "distill.only": True, "distill.coef": 1.3},
    {"loss.kind": "casp", "rollout_correction.kind": "tis", "rollout_correction.cap": 1.5},
    {
        "loss.kind": "grpo",
        "rollout_correction.kind": "icepop",
        "rollout_correction.level": "sequence",
        "rollout_correction.low": 0.3,
        "rollout_correction.high": 3.0,
    },
]
SEEDS = (21, 22)
TEMPERATURE = 0.8


def _inputs(seed: int):
    problem = random_problem(seed, vocab_multiple=2)
    g = torch.Generator().manual_seed(seed + 1000)
    teacher = problem.logits + 1.5 * torch.randn(problem.logits.shape, generator=g, dtype=torch.float64)
    rollout_logp = problem.old_logp + 0.3 * torch.randn(problem.old_logp.shape, generator=g, dtype=torch.float64)
    return problem, teacher, rollout_logp


def sharded_distill_gradients(cases: list[dict], seeds: tuple[int, ...], dtype: torch.dtype) -> list:
    out = []
    for case in cases:
        cfg = _cfg({**case})
        for seed in seeds:
            problem, teacher, rollout_logp = _inputs(seed)
            loss, _, grad = op_loss(
                problem.logits,
                teacher,
                problem.targets,
                problem.mask,
                problem.advantages,
                cfg,
                old_logp=problem.old_logp,
                ref_logp=problem.ref_logp if cfg.kl.coef > 0 else None,
                rollout_logp=rollout_logp if cfg.rollout_correction.kind != "none" else None,
                temperature=TEMPERATURE,
                dtype=dtype,
            )
            out.append((float(loss), grad.to(torch.float64)))
    return out


def dense_distill_loss(problem, teacher_logits, rollout_logp, cfg: AlgoConfig) -> torch.Tensor:
    """The oracle: docs/algorithms.md's loss with a_t = -(logp_s - logp_T) (times distill_coef) in each token's
    advantage, plus distill_coef * agg(KL(q || p~)) over the teacher's top-N, on full-vocabulary float64 logits."""
    logits = problem.logits.clone().requires_grad_(True)
    mask = problem.mask
    log_s = torch.log_softmax(logits / TEMPERATURE, -1)
    log_t = torch.log_softmax(teacher_logits / TEMPERATURE, -1)
    y = problem.targets[..., None]
    reverse = (log_t.gather(-1, y) - log_s.gather(-1, y))[..., 0].detach()
    ids = torch.sort(log_t, dim=-1, descending=True, stable=True).indices[..., : cfg.distill.top_n]
    log_q = torch.log_softmax((teacher_logits / TEMPERATURE).gather(-1, ids), -1)
    log_p = torch.log_softmax((logits / TEMPERATURE).gather(-1, ids), -1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    signal = cfg.distill.signal
    advantages = torch.zeros_like(problem.advantages) if cfg.distill.only else problem.advantages
    rl = reference_loss(
        logits,
        problem.targets,
        problem.old_logp,
        advantages,
        mask,
        cfg,
        ref_logp=problem.ref_logp if cfg.kl.coef > 0 else None,
        temperature=TEMPERATURE,
        rollout_logp=rollout_logp if cfg.rollout_correction.kind != "none" else None,
        token_advantages=cfg.distill.coef * reverse if signal != "topn_forward_kl" else None,
    )
    if signal == "reverse_kl_sampled":
        return logits, rl
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    if cfg.loss.agg == "token_mean":
        term = kl.sum() / mask.sum()
    elif cfg.loss.agg == "seq_mean_token_mean":
        term = sum(kl[b].sum() / mask[b].sum() for b in range(mask.shape[0]) if mask[b].any()) / mask.any(-1).sum()
    else:
        term = kl.sum() / cfg.loss.max_len_norm / mask.any(-1).sum()
    return logits, rl + cfg.distill.coef * term


def _check(per_rank: list[list], tol: dict) -> None:
    index = 0
    for case in CASES:
        cfg = _cfg({**case})
        for seed in SEEDS:
            problem, teacher, rollout_logp = _inputs(seed)
            logits, ref_loss = dense_distill_loss(problem, teacher, rollout_logp, cfg)
            (ref_grad,) = torch.autograd.grad(ref_loss, logits)
            grad = torch.cat([rank_results[index][1] for rank_results in per_rank], dim=-1)
            for rank_results in per_rank:
                assert rank_results[index][0] == pytest.approx(
                    float(ref_loss.detach()), rel=tol["rtol"], abs=tol["atol"]
                ), (case, seed)
            torch.testing.assert_close(grad, ref_grad, **tol, msg=lambda m: f"{case} seed {seed}: {m}")
            index += 1


FP64 = dict(rtol=1e-9, atol=1e-12)
FP32 = dict(rtol=2e-4, atol=2e-6)


def test_every_loss_with_distillation_against_the_dense_oracle_tp1():
    _check([sharded_distill_gradients(CASES, SEEDS, torch.float64)], FP64)


def test_every_loss_with_distillation_against_the_dense_oracle_tp1_fp32():
    _check([sharded_distill_gradients(CASES, SEEDS, torch.float32)], FP32)


@pytest.mark.dist
def test_every_loss_with_distillation_tp2_equals_tp1(workers2):
    per_rank = workers2.run(sharded_distill_gradients, CASES, SEEDS, torch.float64)
    _check(per_rank, FP64)
    tp1 = sharded_distill_gradients(CASES, SEEDS, torch.float64)
    for (loss1, grad1), *ranks in zip(tp1, *per_rank):
        assert all(loss == pytest.approx(loss1, rel=1e-12, abs=1e-14) for loss, _ in ranks)
        torch.testing.assert_close(torch.cat([g for _, g in ranks], dim=-1), grad1, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# Mixing: distill_coef = 0 is the RL loss bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_coefficient_is_the_rl_loss_bit_for_bit(dtype):
    for case in CASES:
        case = {k: v for k, v in case.items() if k not in ("distill.only", "distill.coef")}
        for seed in SEEDS:
            problem, teacher, rollout_logp = _inputs(seed)
            kwargs = dict(
                old_logp=problem.old_logp,
                ref_logp=problem.ref_logp,
                rollout_logp=rollout_logp if case.get("rollout_correction.kind") else None,
                temperature=TEMPERATURE,
                dtype=dtype,
            )
            mixed = op_loss(
                problem.logits,
                teacher,
                problem.targets,
                problem.mask,
                problem.advantages,
                _cfg({**case, "distill.coef": 0.0}),
                **kwargs,
            )
            alone = op_loss(
                problem.logits,
                None,
                problem.targets,
                problem.mask,
                problem.advantages,
                _cfg({**case, "distill.kind": "none"}),
                with_teacher=False,
                **kwargs,
            )
            assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[2], alone[2]), (case, seed)
            assert mixed[1]["distill/reverse_kl"] != 0.0  # the teacher differs: only the coefficient makes it 0


# ---------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"distill.kind": "teacher"}, "algo.distill.teacher_hf_dir: expected the teacher's HF model directory"),
        (
            {"distill.kind": "self", "distill.template": "no field"},
            "algo.distill.template: expected a template holding",
        ),
        (
            {"distill.kind": "self", "distill.template": "{answer} {prompt}"},
            "algo.distill.template: expected a templ",
        ),
        ({"distill.only": True}, "algo.distill.only: expected false under algo.distill.kind=none"),
        (
            {"distill.kind": "teacher", "distill.teacher_hf_dir": "t", "distill.coef": -1.0},
            "algo.distill.coef: expected >= 0, finite, got -1.0",
        ),
        ({"distill.kind": "rkl"}, "algo.distill.kind: got 'rkl'; allowed values: 'none', 'teacher', 'self'"),
        ({"distill.signal": "kl"}, "algo.distill.signal: got 'kl'"),
        ({"distill.top_n": 0}, "algo.distill.top_n: expected >= 1"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(overrides, message):
    """Limits are the loader's (declared on the fields), rules between fields the config's table: both one line."""
    with pytest.raises(ValueError) as e:
        run_config({f"algo.{key}": value for key, value in overrides.items()})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_teacher_inputs_are_named():
    problem = random_problem(3)
    stats = vocab_parallel_token_stats(problem.logits, problem.targets, 3)
    with pytest.raises(ValueError, match="teacher: algo.distill.kind=teacher needs the teacher's scores"):
        policy_loss(stats, None, problem.advantages, problem.mask, _cfg())
    t = vocab_parallel_token_stats(problem.logits, problem.targets, 3)
    teacher = TeacherScores(t.logp, t.topn_ids, t.topn_logp)
    with pytest.raises(ValueError, match="student_at_teacher_ids: algo.distill.signal=both needs"):
        policy_loss(stats, None, problem.advantages, problem.mask, _cfg(), teacher=teacher)
    with pytest.raises(ValueError, match=r"teacher.logp: expected shape"):
        policy_loss(
            stats,
            None,
            problem.advantages,
            problem.mask,
            _cfg({"distill.signal": "reverse_kl_sampled"}),
            teacher=TeacherScores(t.logp[:, :1], t.topn_ids, t.topn_logp),
        )
