"""CRPO through the whole actor (actor/contrast.py, teacher.py): the no-grad first pass and the update agree (the
update's ``crpo_loss`` is crpo_coef x the first pass's L_CRPO), TP = 2 equals TP = 1, and crpo_coef = 0 updates
exactly as GRPO does (loss and gradient norm bit for bit)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.data import PromptItem
from tests.integration.actor.test_teacher import distill_batch, flat_targets, teacher_actor

TEMPLATE = "Answer: {answer}\n"
ITEMS = [PromptItem("p0", "", (1, 2), "12", "math"), PromptItem("p1", "", (1, 2), "34", "math")]
CRPO = {
    "distill.kind": "crpo",
    "distill.template": TEMPLATE,
    "distill.crpo.top_k": 6,
    "distill.crpo.positive_share": 0.3,
    "distill.crpo.coef": 5.0,
}


def crpo_updates(hf_dir: str, tp: int, runs: list[dict]) -> list[dict]:
    """One fresh actor's update metrics per algo override of ``runs`` (rows 0 and 3 correct: both groups have a
    correct response; row 0 of group 0 is its only one and reads itself)."""
    from megatron_rlvr.runtime.distributed import model_parallel

    out = []
    for algo in runs:
        with model_parallel(tp=tp, pp=1, seed=11):
            actor = teacher_actor(hf_dir, tp, algo)
            batch = distill_batch(actor.vocab_size, rewards=[1.0, 0.0, 0.0, 1.0])
            statistics = actor.score(batch, ITEMS, mini_batches=1)
            out.append(actor.update(batch, flat_targets(), statistics, mini_batches=1))
    return out


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("student"), seed=3))


@pytest.mark.dist
def test_crpo_update_tp2_equals_tp1_and_zero_coefficient_is_grpo(workers2, student):
    runs = [CRPO, {**CRPO, "distill.crpo.coef": 0.0}, {}]
    tp1 = workers2.run(crpo_updates, student, 1, runs)  # TP = 1 x DP = 2
    tp2 = workers2.run(crpo_updates, student, 2, runs[:1])  # TP = 2 x DP = 1
    crpo, zero, grpo = tp1[0]
    assert crpo["crpo/loss"] > 0.05 and crpo["crpo/no_context_share"] == 0.0
    assert crpo["loss/crpo_loss"] == pytest.approx(5.0 * crpo["crpo/loss"], rel=1e-6)  # pass 2's value = pass 1's
    assert crpo["actor/grad_norm"] != grpo["actor/grad_norm"]
    for key in ("actor/loss", "actor/grad_norm", "loss/pg_loss"):
        assert zero[key] == grpo[key], key
    for rank in tp1 + tp2:
        for key in ("actor/loss", "actor/grad_norm", "crpo/loss", "loss/crpo_loss", "crpo/sim", "crpo/positive_sim"):
            assert rank[0][key] == pytest.approx(crpo[key], rel=1e-6, abs=1e-6), key


def _teacher_params(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for c in actor.teacher.chunks for p in c.parameters()]


def ema_teacher_round_trip(hf_dir: str, ckpt_root: str, tp: int):
    """An EMA teacher after one update (against decay * before + (1 - decay) * policy), then saved, restored into a
    fresh actor, and both updated once more: the teachers' weights of each stage, live and restored."""
    from megatron_rlvr import checkpoint
    from megatron_rlvr.runtime.distributed import model_parallel

    algo = {**CRPO, "distill.crpo.teacher": "ema", "distill.crpo.ema_decay": 0.25}

    def step(actor):
        batch = distill_batch(actor.vocab_size, rewards=[1.0, 0.0, 0.0, 1.0])
        return actor.update(batch, flat_targets(), actor.score(batch, ITEMS, mini_batches=1), mini_batches=1)

    with model_parallel(tp=tp, pp=1, seed=11):
        live = teacher_actor(hf_dir, tp, algo)
        before = _teacher_params(live)
        step(live)
        policy = [p.detach() for c in live.model_chunks for p in c.parameters()]
        expected = [b.clone().mul_(0.25).add_(p.to(b.dtype), alpha=0.75) for b, p in zip(before, policy)]
        followed = _teacher_params(live)
        checkpoint.save(ckpt_root, 1, live, {"step": 1})
        restored = teacher_actor(hf_dir, tp, algo)
        fresh = _teacher_params(restored)
        checkpoint.load(checkpoint.resolve(ckpt_root, "latest"), restored)
        loaded = _teacher_params(restored)
        live_metrics, restored_metrics = step(live), step(restored)
        return (
            before,
            expected,
            followed,
            fresh,
            loaded,
            (_teacher_params(live), live_metrics),
            (_teacher_params(restored), restored_metrics),
        )


@pytest.mark.dist
def test_ema_teacher_follows_the_policy_and_resumes_exactly(workers2, student, tmp_path):
    for before, expected, followed, fresh, loaded, live, restored in workers2.run(
        ema_teacher_round_trip, student, str(tmp_path / "ckpt"), 2
    ):
        assert any(not torch.equal(b, f) for b, f in zip(before, followed))  # it moved
        assert all(torch.equal(e, f) for e, f in zip(expected, followed))
        assert any(not torch.equal(f, x) for f, x in zip(fresh, followed))  # a fresh actor's is the initial one
        assert all(torch.equal(f, x) for f, x in zip(followed, loaded))  # the checkpoint holds the EMA
        assert all(torch.equal(a, b) for a, b in zip(live[0], restored[0]))
        assert live[1]["actor/loss"] == restored[1]["actor/loss"]
        assert live[1]["crpo/loss"] == restored[1]["crpo/loss"]
