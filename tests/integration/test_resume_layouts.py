"""A resumed run equals an uninterrupted one (tests/integration/resume_table.py), the rows laid out otherwise: LoRA (the engines
serving the adapter alone, the KL term against the free reference), context parallelism (actor.cp=2) and one-step-off
(an engine rank samples the next step while the actor updates: the rollout sampled ahead is in the checkpoint). Besides the equalities, what their references must show: a LoRA checkpoint holds the adapters and their
optimizer state only, the run ends with the merged HF model and a PEFT adapter directory, a resume onto another base
is refused in one line; the CP run's steps are finite on both ranks, report CP's padding and end with its exports."""

from __future__ import annotations

import json

import pytest

from tests.integration.resume_table import STEPS, Runs, assert_resumed_equals_uninterrupted
from tests.integration.training_runs import make_tiny_model, train

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(workers2, tmp_path_factory):
    return Runs(workers2, make_tiny_model(tmp_path_factory.mktemp("qwen")), tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("scenario", ["lora", "cp", "one_step_off"])
def test_a_resumed_run_repeats_the_uninterrupted_metrics(runs, scenario):
    assert_resumed_equals_uninterrupted(runs, scenario)


def _checkpoint_keys(step_dir: str) -> list[str]:
    from megatron.core import dist_checkpointing

    return sorted(dist_checkpointing.load_tensors_metadata(step_dir))


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_only(runs):
    full = runs.reference("lora")[0]
    keys = _checkpoint_keys(str(runs.reference_dir("lora") / "checkpoints" / "step-000002"))
    assert keys and all(k.startswith(("lora.", "optimizer.")) for k in keys), keys[:5]
    assert any(k.startswith("lora.decoder.layers.0.self_attention.linear_qkv.") for k in keys)
    assert full[0]["loss/kl_ref"] == 0.0 and full[-1]["loss/kl_ref"] > 0  # step 1: the base is the policy, exactly


def test_a_lora_run_exports_the_merged_model_and_a_peft_adapter(runs):
    runs.reference("lora")
    run = runs.reference_dir("lora")
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert (run / "hf" / "model.safetensors").is_file()


def test_a_lora_resume_onto_another_base_is_refused(runs, workers2, tmp_path):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from tests.integration.resume_table import REFERENCES

    runs.reference("lora")
    other = tmp_path / "other_base"  # the same architecture, other weights
    make_tiny_hf_model("qwen2", other, seed=6, vocab_size=1002)
    saved = runs.reference_dir("lora") / "checkpoints" / "step-000002"
    extra = [*REFERENCES["lora"].overrides, f"checkpoint.resume={saved}"]
    with pytest.raises(Exception) as e:
        workers2.run(train, str(other), str(tmp_path / "run"), 2, 1, STEPS, extra, timeout_s=900)
    assert "its LoRA adapters were trained on the base" in str(e.value)


def test_the_cp2_run_is_finite_on_both_ranks_and_reports_its_padding(runs):
    histories = runs.reference("cp")
    assert [len(h) for h in histories] == [STEPS, STEPS]
    for metrics in histories[0]:
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/nonfinite"] == 0
        assert 0 <= metrics["actor/cp_padding"] < 1  # CP's per-sequence padding is reported
        assert metrics["loss/kl_ref"] >= 0
    untimed = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in h] for h in histories]
    assert untimed[0] == untimed[1]  # both CP ranks report the same step metrics
    run = runs.reference_dir("cp")
    assert (run / "checkpoints").is_dir() and (run / "hf").is_dir()


def test_one_step_off_samples_each_step_with_the_weights_one_update_older(runs):
    full = runs.reference("one_step_off")[0]
    assert [m["rollout/staleness"] for m in full] == [0.0, 1.0, 1.0, 1.0]
    assert full[0]["rollout/logp_mismatch"] < 1e-4 < full[1]["rollout/logp_mismatch"]  # fresh, then one update stale
