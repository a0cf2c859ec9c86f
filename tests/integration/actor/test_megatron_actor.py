"""MegatronActor: the statistics pass and the update give the same numbers at every (TP, PP) layout, the interleaved
schedule (virtual pipeline stages) included, and the update is exactly the gradient of the whole mini-batch loss
whatever the micro-batch size; with algo.kl.coef > 0 the frozen reference starts equal to the policy and stays put
while the policy trains; PBA builds the reference too, and the batch's per-sequence KL coefficient reaches the loss
through the micro-batches in place of algo.kl.coef."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.testing.configs import algo_config, replaced

pytestmark = pytest.mark.dist


ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


def _targets(**kwargs):
    from megatron_rlvr.protocols import Targets

    return Targets(advantages=torch.tensor(ADVANTAGES), **kwargs)


def _batch(vocab: int, seed: int = 0):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    b, s = 4, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.tensor([10, 7, 9, 5])  # right padding: prompt of 3, responses of varied length
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 2 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask)


def _actor_numbers(hf_dir: str, tp: int, pp: int, micro_batch_size: int, loss: str = "casp", vpp: int | None = None):
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.protocols import Statistics
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, vpp=vpp, seed=11):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=tp, pp=pp, vpp=vpp, micro_batch_size=micro_batch_size, lr=1e-3),
            algo_config({"loss.kind": loss, "loss.tau_q": 0.5}),
            temperature=0.9,
            total_steps=2,
        )
        assert actor.reference is None  # no kl_coef: no reference model, no memory spent on one
        batch = _batch(actor.vocab_size)
        old_logp = actor.compute_old_logp(batch)
        metrics = actor.update(batch, _targets(), Statistics(old_logp=old_logp), mini_batches=1)
        return old_logp, actor.compute_old_logp(batch), metrics


def _reference_numbers(hf_dir: str, tp: int, pp: int, micro_batch_size: int):
    """Policy and reference log-probs before and after one update with the KL term, and a second update's metrics."""
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=11):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=tp, pp=pp, micro_batch_size=micro_batch_size, lr=1e-3),
            algo_config({"loss.kind": "grpo", "kl.coef": 0.1}),
            temperature=0.9,
            total_steps=2,
        )
        assert all(not p.requires_grad for c in actor.reference for p in c.parameters())
        batch = _batch(actor.vocab_size)
        statistics = actor.score(batch, [], mini_batches=1)
        assert statistics.old_logp is not None and statistics.ref_logp is not None  # a reference: a statistics pass
        first = actor.update(batch, _targets(), statistics, mini_batches=1)
        after = actor.compute_old_logp(batch), actor.compute_ref_logp(batch)
        second = actor.update(batch, _targets(), statistics, mini_batches=1)  # the policy moved: the KL is not zero
        return (statistics.old_logp, statistics.ref_logp), after, first, second


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=3))


@pytest.fixture(scope="module")
def reference(workers2, tiny_qwen):
    # (TP, PP) = (1, 1) with DP = 2 and one sequence per micro-batch
    return workers2.run(_actor_numbers, tiny_qwen, 1, 1, 1)[0]


@pytest.mark.parametrize("tp,pp,vpp,mbs", [(2, 1, None, 2), (1, 2, None, 1), (1, 2, 2, 1)])
def test_update_matches_reference_layout(workers2, tiny_qwen, reference, tp, pp, vpp, mbs):
    ref_old, ref_new, ref_metrics = reference
    old, new, metrics = workers2.run(_actor_numbers, tiny_qwen, tp, pp, mbs, vpp=vpp)[0]
    torch.testing.assert_close(old, ref_old, rtol=0, atol=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-4)
    assert metrics["actor/loss"] == pytest.approx(ref_metrics["actor/loss"], rel=1e-4, abs=1e-6)
    # the loss's terms are shares of the mini-batch loss: summed over micro-batches and DP ranks, not averaged
    for m in (metrics, ref_metrics):
        assert m["loss/pg_loss"] == pytest.approx(m["actor/loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(new, ref_new, rtol=0, atol=1e-4)
    # the update moved the policy
    assert (new - old).abs()[_batch(10).response_mask].max() > 1e-4


@pytest.mark.parametrize("tp,pp,mbs", [(2, 1, 2), (1, 2, 1)])
def test_reference_is_the_initial_policy_and_stays_frozen(workers2, tiny_qwen, tp, pp, mbs):
    (old, ref), (new, ref_after), first, second = workers2.run(_reference_numbers, tiny_qwen, tp, pp, mbs)[0]
    # the same weights bit for bit, the same code on the same micro-batches: the same numbers bit for bit
    assert torch.equal(ref, old)
    assert torch.equal(ref_after, ref)  # the update left the reference untouched
    assert (new - ref_after).abs()[_batch(10).response_mask].max() > 1e-4  # ... and moved the policy
    assert first["loss/kl_ref"] == 0.0  # policy == reference at the first update, exactly
    assert 0 < second["loss/kl_ref"] < float("inf")
    total = second["loss/pg_loss"] + 0.1 * second["loss/kl_ref"]  # the logged terms add up to the loss
    assert second["actor/loss"] == pytest.approx(total, rel=1e-5)


def test_targets_carry_the_kl_coefficient():
    targets = _targets(kl_coef=torch.tensor([0.1, 0.0, 0.2, 0.3]))
    picked = targets.select(torch.tensor([2, 0]))
    assert picked.kl_coef.tolist() == pytest.approx([0.2, 0.1]) and picked.advantages.tolist() == [0.5, 1.0]
    assert targets.select(slice(1, 3)).kl_coef.tolist() == pytest.approx([0.0, 0.2])
    assert targets.to(torch.device("cpu")).kl_coef is not None and _targets().select(slice(0, 2)).kl_coef is None


def _per_sequence_kl_numbers(hf_dir: str, tp: int, pp: int, micro_batch_size: int):
    """Updates at lr = 0 (the weights stay) with a reference log-prob off the policy: the loss and gradient with a
    per-sequence coefficient against algo.kl.coef, and the metrics with a mixed one."""
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.protocols import Statistics
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=11):
        pba = algo_config({"loss.kind": "casp", "loss.tau_q": 0.5, "kl.pba.enabled": True, "kl.pba.coef": 0.1})
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=tp, pp=pp, micro_batch_size=micro_batch_size, lr=0.0),
            pba,
            temperature=0.9,
            total_steps=2,
        )
        assert actor.reference is not None  # PBA's anchor needs the frozen base even with algo.kl.coef = 0
        batch = _batch(actor.vocab_size)
        old_logp = actor.compute_old_logp(batch)
        ref_logp = actor.compute_ref_logp(batch) + 0.3 * torch.randn(
            old_logp.shape, generator=torch.Generator().manual_seed(2)
        )
        statistics = Statistics(old_logp=old_logp, ref_logp=ref_logp)

        def update(cfg, kl_coef):
            actor.algo_cfg = cfg
            targets = _targets(kl_coef=None if kl_coef is None else torch.tensor(kl_coef))
            metrics = actor.update(batch, targets, statistics, mini_batches=1)
            grads = torch.cat([p.main_grad.reshape(-1).clone() for c in actor.model for p in c.module.parameters()])
            return metrics, grads

        return {
            "global": update(replaced(pba, {"kl.coef": 0.1}), None),
            "uniform": update(pba, [0.1, 0.1, 0.1, 0.1]),
            "mixed": update(pba, [0.1, 0.0, 0.1, 0.0]),
            "zero": update(replaced(pba, {"kl.coef": 0.5}), [0.0, 0.0, 0.0, 0.0]),
            "none": update(replaced(pba, {"kl.pba.enabled": False}), None),
        }


@pytest.mark.parametrize("tp,pp,mbs", [(2, 1, 1), (1, 2, 1)])
def test_per_sequence_kl_coefficient_reaches_the_loss(workers2, tiny_qwen, tp, pp, mbs):
    runs = workers2.run(_per_sequence_kl_numbers, tiny_qwen, tp, pp, mbs)[0]
    (m_global, g_global), (m_uniform, g_uniform) = runs["global"], runs["uniform"]
    # the same coefficient for every sequence is algo.kl.coef (up to the order of float sums)
    assert m_uniform["actor/loss"] == pytest.approx(m_global["actor/loss"], rel=1e-5)
    torch.testing.assert_close(g_uniform, g_global, rtol=1e-5, atol=1e-7)
    assert m_uniform["loss/kl_loss"] == pytest.approx(0.1 * m_global["loss/kl_ref"], rel=1e-5)
    # mixed: only the anchored rows' KL; the logged terms add up to the loss
    m_mixed, g_mixed = runs["mixed"]
    assert 0 < m_mixed["loss/kl_loss"] < m_uniform["loss/kl_loss"]
    assert m_mixed["actor/loss"] == pytest.approx(m_mixed["loss/pg_loss"] + m_mixed["loss/kl_loss"], rel=1e-5)
    assert not torch.allclose(g_mixed, g_uniform)
    # zero everywhere: no KL, whatever algo.kl.coef says
    (m_zero, g_zero), (m_none, g_none) = runs["zero"], runs["none"]
    assert m_zero["loss/kl_loss"] == 0.0
    assert m_zero["actor/loss"] == pytest.approx(m_none["actor/loss"], rel=1e-6)
    torch.testing.assert_close(g_zero, g_none, rtol=0, atol=0)


def _handed_over_step(hf_dir: str):
    """The trainer's two actor calls on one step (score, then update over two mini-batches) with every statistic the
    loss can read (a KL reference with per-sequence coefficients, CRPO's teacher and its groups, the rollout
    correction): whether the hand-offs are frozen dataclasses, and whether either call wrote into a tensor of them
    (version counters, which count writes through any view)."""
    import dataclasses

    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel
    from megatron_rlvr.testing.handoffs import assert_untouched, versions

    algo = algo_config(
        {
            "loss.kind": "casp",
            "loss.tau_q": 0.5,
            "kl.coef": 0.1,
            "distill.kind": "crpo",
            "distill.template": "Answer: {answer}\n",
            "distill.crpo.top_k": 6,
            "rollout_correction.kind": "tis",
        }
    )
    items = [PromptItem("p0", "", (1, 2), "12", "math"), PromptItem("p1", "", (1, 2), "34", "math")]
    with model_parallel(tp=2, pp=1, seed=11):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(tp=2, micro_batch_size=1, lr=1e-3),
            algo,
            temperature=0.9,
            total_steps=2,
        )
        plain = _batch(actor.vocab_size)
        engine = actor.compute_old_logp(plain) + 0.1 * torch.randn(plain.engine_logp.shape)
        rollouts = dataclasses.replace(plain, engine_logp=engine, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))
        targets = _targets(kl_coef=torch.tensor([0.1, 0.0, 0.2, 0.1]))
        given = versions(rollouts, targets)
        statistics = actor.score(rollouts, items, mini_batches=2)
        scored = versions(rollouts, targets, statistics)
        metrics = actor.update(rollouts, targets, statistics, mini_batches=2)
        assert_untouched(given, rollouts, targets)  # raises naming the field written
        assert_untouched(scored, rollouts, targets, statistics)
        frozen = []
        for handoff in (rollouts, targets, statistics, statistics.teacher, statistics.context_groups):
            try:
                setattr(handoff, dataclasses.fields(handoff)[0].name, None)
            except dataclasses.FrozenInstanceError:
                frozen.append(type(handoff).__name__)
        present = [
            name
            for name in ("old_logp", "ref_logp", "teacher", "context_groups")
            if getattr(statistics, name) is not None
        ]
        return frozen, present, sorted(scored), metrics


def test_score_and_update_write_into_nothing_they_are_given(workers2, tiny_qwen):
    """No stage writes into what another made: the rollouts and targets reach ``score`` and ``update``, the
    statistics reach ``update``, and none of their tensors is written (nor can a field be set)."""
    for frozen, present, tensors, metrics in workers2.run(_handed_over_step, tiny_qwen):
        assert frozen == ["Rollouts", "Targets", "Statistics", "TeacherScores", "ContextGroups"]
        assert present == ["old_logp", "ref_logp", "teacher", "context_groups"]
        assert len(tensors) == 13  # 4 of the rollouts (no routing), 2 of the targets, 7 of the statistics
        # the step ran every term: the loss, the KL with per-sequence coefficients, CRPO, the correction
        assert "loss/kl_loss" in metrics and metrics["crpo/loss"] > 0 and "rollout_correction/weight_mean" in metrics
        assert metrics["rollout/logp_mismatch"] > 0
