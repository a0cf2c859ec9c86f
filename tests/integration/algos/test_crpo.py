"""CRPO's contrastive term (algos/crpo.py) through the fused op and ops.given_ids, in its two-pass form split over
micro-batches: against a dense float64 oracle of the formula (several groups, ragged lengths, a group without a
correct response), crpo_coef = 0 bit-equal to GRPO, crpo_positive_share = 1 giving exactly zero, the gradient as a
per-position weighted self-distillation reverse-KL gradient, TP = 2 equal to TP = 1, and the one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlvr.algos import AlgoConfig, policy_loss
from megatron_rlvr.algos.crpo import group_weights, positive_count, support_terms
from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.ops.given_ids import logits_at_ids
from megatron_rlvr.testing.configs import algo_config, run_config
from tests.support.algos.dense_reference import reference_loss

TEMPERATURE = 0.8
GROUPS, GROUP_SIZE = 3, 3


def _cfg(overrides: dict | None = None) -> AlgoConfig:
    base = {
        "loss.kind": "grpo",
        "distill.kind": "crpo",
        "distill.crpo.top_k": 5,
        "distill.crpo.positive_share": 0.3,
        "distill.crpo.tau": 0.7,
        "distill.crpo.coef": 5.0,
    }
    return algo_config({**base, **(overrides or {})})


def _problem(seed: int):
    """GROUPS x GROUP_SIZE ragged responses over a vocabulary of 12; the last group has no correct response."""
    g = torch.Generator().manual_seed(seed)
    b, t, v = GROUPS * GROUP_SIZE, 7, 12
    logits = 2.0 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    teacher = logits + 1.5 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    with torch.no_grad():
        logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, targets[..., None])[..., 0]
    old_logp = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    group = torch.arange(b) // GROUP_SIZE
    context = group != GROUPS - 1
    return dict(
        logits=logits,
        teacher=teacher,
        targets=targets,
        mask=mask,
        old_logp=old_logp,
        advantages=advantages,
        group=group,
        context=context,
    )


def _shard(x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    width = x.shape[-1] // tp
    return x[..., rank * width : (rank + 1) * width]


def op_crpo_loss(p: dict, cfg: AlgoConfig, splits: tuple[int, ...], dtype=torch.float64):
    """This rank's (summed loss, metrics of the first pass, logits-shard gradient) in the actor's two-pass form:
    pass 1 without grad over the whole batch (sim, dE -> group_weights), pass 2 per micro-batch (rows ``splits``)."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if tp > 1 else None
    vocab = p["logits"].shape[-1]
    start = rank * (vocab // tp)
    kw = dict(vocab_start=start, temperature=TEMPERATURE, group=group)
    t_shard = _shard(p["teacher"], rank, tp).to(dtype)
    t_stats = vocab_parallel_token_stats(
        t_shard,
        p["targets"],
        cfg.distill.crpo.top_k,
        group=group,
        vocab_start=start,
        vocab_size=vocab,
        temperature=TEMPERATURE,
    )
    _, t_at = logits_at_ids(t_shard, t_stats.topn_ids, **kw)
    teacher = TeacherScores(t_stats.logp, t_stats.topn_ids, t_at)
    shard = _shard(p["logits"], rank, tp).to(dtype)
    with torch.no_grad():  # pass 1
        _, s_at = logits_at_ids(shard, teacher.topn_ids, **kw)
        sim, d_entropy = support_terms(s_at, teacher.topn_logits, p["mask"])
    weights, first = group_weights(sim, d_entropy, p["mask"], p["group"], p["context"], cfg)
    shard = shard.clone().requires_grad_(True)
    total = torch.zeros((), dtype=dtype)
    num_tokens, num_seqs = float(p["mask"].sum()), float((p["mask"].sum(-1) > 0).sum())
    bounds = [0, *splits, len(p["mask"])]
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # pass 2: one micro-batch at a time
        rows = slice(lo, hi)
        logits, student_at = logits_at_ids(shard[rows], teacher.topn_ids[rows], **kw)
        stats = vocab_parallel_token_stats(
            logits,
            p["targets"][rows],
            3,
            group=group,
            vocab_start=start,
            vocab_size=vocab,
            temperature=TEMPERATURE,
        )
        loss, _ = policy_loss(
            stats,
            p["old_logp"][rows].to(dtype),
            p["advantages"][rows].to(dtype),
            p["mask"][rows],
            cfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            target_ids=p["targets"][rows],
            teacher=TeacherScores(*(x[rows] for x in (teacher.logp, teacher.topn_ids, teacher.topn_logits))),
            student_at_teacher_ids=student_at,
            crpo_weights=weights[rows],
        )
        loss.backward()
        total = total + loss.detach()
    return float(total), first, shard.grad.detach().to(torch.float64)


def dense_crpo(p: dict, cfg: AlgoConfig, logits: torch.Tensor) -> torch.Tensor:
    """The oracle: L_CRPO of docs/distillation.md on full-vocabulary float64 logits, by autograd."""
    z_t = p["teacher"] / TEMPERATURE
    order = torch.sort(z_t, dim=-1, descending=True, stable=True).indices[..., : cfg.distill.crpo.top_k]
    log_q = torch.log_softmax(z_t.gather(-1, order), -1)
    log_p = torch.log_softmax((logits / TEMPERATURE).gather(-1, order), -1)
    sim = -(log_p.exp() * (log_p - log_q)).sum(-1)
    d_entropy = (log_p.exp() * log_p).sum(-1) - (log_q.exp() * log_q).sum(-1)
    total = torch.zeros((), dtype=torch.float64)
    groups = p["group"].unique()
    for g in groups.tolist():
        rows = p["group"] == g
        if not bool(p["context"][rows].all()):
            continue
        s, de = sim[rows][p["mask"][rows]], d_entropy[rows][p["mask"][rows]].detach()
        k = positive_count(cfg.distill.crpo.positive_share, len(s))
        positive = torch.sort(de, stable=True).indices[:k]
        total = (
            total
            - torch.logsumexp(s[positive] / cfg.distill.crpo.tau, 0)
            + torch.logsumexp(s / cfg.distill.crpo.tau, 0)
        )
    return total / len(groups)


def dense_total(p: dict, cfg: AlgoConfig) -> tuple[float, torch.Tensor]:
    logits = p["logits"].clone().requires_grad_(True)
    grpo = reference_loss(logits, p["targets"], p["old_logp"], p["advantages"], p["mask"], cfg, temperature=TEMPERATURE)
    loss = grpo + cfg.distill.crpo.coef * dense_crpo(p, cfg, logits)
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss.detach()), grad


SEEDS = (0, 1, 2)
SPLITS = ((), (2, 5), (4,))
FP64 = dict(rtol=1e-9, atol=1e-12)


def crpo_cases(dtype=torch.float64) -> list:
    return [op_crpo_loss(_problem(seed), _cfg(), splits, dtype) for seed, splits in zip(SEEDS, SPLITS)]


def test_loss_and_gradient_against_the_dense_oracle():
    for (loss, first, grad), seed in zip(crpo_cases(), SEEDS):
        p = _problem(seed)
        ref_loss, ref_grad = dense_total(p, _cfg())
        assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12), seed
        torch.testing.assert_close(grad, ref_grad, **FP64)
        assert first["crpo/no_context_share"] == 1 / GROUPS and first["crpo/loss"] > 0.1  # a term that matters
        assert first["crpo/loss"] == pytest.approx(float(dense_crpo(p, _cfg(), p["logits"])), rel=1e-10)


@pytest.mark.dist
def test_tp2_equals_tp1(workers2):
    per_rank = workers2.run(crpo_cases)
    for (loss1, _, grad1), *ranks in zip(crpo_cases(), *per_rank):
        assert all(loss == pytest.approx(loss1, rel=1e-6, abs=1e-6) for loss, _, _ in ranks)
        torch.testing.assert_close(torch.cat([g for _, _, g in ranks], dim=-1), grad1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_coefficient_is_grpo_bit_for_bit(dtype):
    p = _problem(3)
    loss, _, grad = op_crpo_loss(p, _cfg({"distill.crpo.coef": 0.0}), (4,), dtype)
    grpo_loss, grpo_grad = _grpo_alone(
        p, algo_config({"loss.kind": "grpo"}), (4,), dtype
    )  # no teacher, same micro-batches
    assert torch.equal(torch.tensor(loss), torch.tensor(grpo_loss))
    assert torch.equal(grad, grpo_grad)


def _grpo_alone(p: dict, cfg: AlgoConfig, splits, dtype):
    vocab = p["logits"].shape[-1]
    shard = p["logits"].to(dtype).clone().requires_grad_(True)
    num_tokens, num_seqs = float(p["mask"].sum()), float((p["mask"].sum(-1) > 0).sum())
    total = torch.zeros((), dtype=dtype)
    bounds = [0, *splits, len(p["mask"])]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = slice(lo, hi)
        stats = vocab_parallel_token_stats(
            shard[rows], p["targets"][rows], 3, vocab_size=vocab, temperature=TEMPERATURE
        )
        loss, _ = policy_loss(
            stats,
            p["old_logp"][rows].to(dtype),
            p["advantages"][rows].to(dtype),
            p["mask"][rows],
            cfg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            target_ids=p["targets"][rows],
        )
        loss.backward()
        total = total + loss.detach()
    return float(total), shard.grad.detach().to(torch.float64)


def test_whole_positive_set_gives_exactly_zero():
    """p = 100 %: P_g is the whole group, so numerator = denominator and L_CRPO = 0 with a zero gradient exactly:
    the formula does not reduce to self-distillation at p = 100 % (docs/distillation.md, "CRPO")."""
    p = _problem(4)
    cfg = _cfg({"distill.crpo.positive_share": 1.0})
    loss, first, grad = op_crpo_loss(p, cfg, (3,))
    grpo_loss, grpo_grad = _grpo_alone(p, algo_config({"loss.kind": "grpo"}), (3,), torch.float64)
    assert first["crpo/loss"] == 0.0
    assert loss == pytest.approx(grpo_loss, abs=1e-15)
    torch.testing.assert_close(grad, grpo_grad, rtol=0, atol=1e-15)


def test_gradient_is_a_weighted_self_distillation_reverse_kl_gradient():
    """d L_CRPO = sum_t c_t d sim_t = -sum_t c_t d KL(p_t || q_t): self-distillation's reverse KL on the same
    support (the analytic gradient of sum_t KL(p_t || q_t) over the teacher's top-K, q detached), each position
    weighted by -c_t = (w^P_t - w_t) / (tau N_groups); checked against autograd of that weighted KL in float64."""
    p = _problem(5)
    cfg = _cfg({"distill.crpo.coef": 1.0})
    z_t = p["teacher"] / TEMPERATURE
    order = torch.sort(z_t, dim=-1, descending=True, stable=True).indices[..., : cfg.distill.crpo.top_k]
    logits = p["logits"].clone().requires_grad_(True)
    log_q = torch.log_softmax(z_t.gather(-1, order), -1)
    log_p = torch.log_softmax((logits / TEMPERATURE).gather(-1, order), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    sim, d_entropy = support_terms((p["logits"] / TEMPERATURE).gather(-1, order), z_t.gather(-1, order), p["mask"])
    weights, _ = group_weights(sim, d_entropy, p["mask"], p["group"], p["context"], cfg)
    coef = weights[..., 0]
    (sd_grad,) = torch.autograd.grad(torch.where(p["mask"], -coef * kl, torch.zeros_like(kl)).sum(), logits)
    (crpo_grad,) = torch.autograd.grad(dense_crpo(p, cfg, logits), logits)
    torch.testing.assert_close(sd_grad, crpo_grad, **FP64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"distill.crpo.top_k": 0}, "algo.distill.crpo.top_k: expected >= 1, got 0"),
        ({"distill.crpo.positive_share": 0.0}, "algo.distill.crpo.positive_share: expected in (0, 1], got 0.0"),
        ({"distill.crpo.positive_share": 1.5}, "algo.distill.crpo.positive_share: expected in (0, 1], got 1.5"),
        ({"distill.crpo.tau": 0.0}, "algo.distill.crpo.tau: expected > 0, finite, got 0.0"),
        ({"distill.crpo.coef": -1.0}, "algo.distill.crpo.coef: expected >= 0, finite, got -1.0"),
        ({"distill.crpo.correct_reward": float("nan")}, "algo.distill.crpo.correct_reward: expected finite, got nan"),
        ({"distill.only": True}, "algo.distill.only: expected false under algo.distill.kind=crpo"),
        (
            {"distill.crpo.teacher": "current"},
            "algo.distill.crpo.teacher: got 'current'; allowed values: 'frozen', 'ema'",
        ),
        ({"distill.crpo.ema_decay": 1.5}, "algo.distill.crpo.ema_decay: expected in [0, 1], got 1.5"),
        ({"distill.template": "no field"}, "algo.distill.template: expected a template holding {answer}"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(overrides, message):
    """Limits are the loader's (declared on the fields), rules between fields the config's table: both one line."""
    settings = {"loss.kind": "grpo", "distill.kind": "crpo", **overrides}
    with pytest.raises(ValueError) as e:
        run_config({f"algo.{key}": value for key, value in settings.items()})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_missing_weights_are_named():
    p = _problem(0)
    with pytest.raises(ValueError, match=r"^crpo_weights: algo.distill.kind=crpo needs"):
        _grpo_alone_with_teacher_but_no_weights(p)


def _grpo_alone_with_teacher_but_no_weights(p: dict) -> None:
    cfg = _cfg()
    stats = vocab_parallel_token_stats(p["logits"], p["targets"], 5, temperature=TEMPERATURE)
    teacher = TeacherScores(stats.logp.detach(), stats.topn_ids, stats.topn_logp.detach())
    policy_loss(
        stats,
        p["old_logp"],
        p["advantages"],
        p["mask"],
        cfg,
        teacher=teacher,
        student_at_teacher_ids=stats.topn_logp,
    )


def test_ema_teacher_with_lora_is_one_line():
    from megatron_rlvr.config import load_config
    from megatron_rlvr.errors import ConfigError

    crpo = ["algo.distill.kind=crpo", "algo.distill.crpo.teacher=ema", "actor.lora.rank=4", "actor.lora.alpha=8"]
    with pytest.raises(ConfigError) as e:
        load_config(None, crpo).validate()
    assert str(e.value).startswith("algo.distill.crpo.teacher=ema: not with actor.lora") and "\n" not in str(e.value)
    load_config(None, [*crpo[:1], *crpo[2:]]).validate()  # the frozen teacher is fine under LoRA
