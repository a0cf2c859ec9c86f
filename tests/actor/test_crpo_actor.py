"""CRPO through the whole actor (actor/contrast.py, teacher.py): the no-grad first pass and the update agree (the
update's ``crpo_loss`` is crpo_coef x the first pass's L_CRPO), TP = 2 equals TP = 1, and crpo_coef = 0 updates
exactly as GRPO does (loss and gradient norm bit for bit)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.data import PromptItem
from tests.actor.test_teacher import _actor, _batch

TEMPLATE = "Answer: {answer}\n"
ITEMS = [PromptItem("p0", "", (1, 2), "12", "math"), PromptItem("p1", "", (1, 2), "34", "math")]
CRPO = dict(distill="crpo", self_distill_template=TEMPLATE, crpo_top_k=6, crpo_positive_share=0.3, crpo_coef=5.0)


def crpo_updates(hf_dir: str, tp: int, runs: list[dict]) -> list[dict]:
    """One fresh actor's update metrics per algo override of ``runs`` (rows 0 and 3 correct: both groups have a
    correct response; row 0 of group 0 is its only one and reads itself)."""
    from megatron_rlvr.runtime.distributed import model_parallel

    out = []
    for algo in runs:
        with model_parallel(tp=tp, pp=1, seed=11):
            actor = _actor(hf_dir, tp, algo)
            batch = _batch(actor.vocab_size)
            batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
            if actor.teacher is not None:
                actor.teacher.attach(batch, ITEMS)
            out.append(actor.update(batch, mini_batches=1))
    return out


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("student"), seed=3))


@pytest.mark.dist
def test_crpo_update_tp2_equals_tp1_and_zero_coefficient_is_grpo(workers2, student):
    runs = [CRPO, {**CRPO, "crpo_coef": 0.0}, {}]
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
