"""The training loop with LoRA (actor.lora, docs/lora.md) on CPU, TP = 2, the engines serving the adapter alone
(sync=adapters) and the KL term against the free reference: a resumed run repeats the uninterrupted one's metrics
exactly; the checkpoint holds the adapters and their optimizer state only; the run ends with the merged HF model and
a PEFT adapter directory; a resume onto another base is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.training_runs import COMPARED, train

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

_LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.sync=adapters", "algo.kl.coef=0.1"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen_lora"), seed=5))


def _checkpoint_keys(step_dir: str) -> list[str]:
    from megatron.core import dist_checkpointing

    return sorted(dist_checkpointing.load_tensors_metadata(step_dir))


def test_lora_resume_repeats_uninterrupted_metrics(workers2, tiny_model, tmp_path):
    full = workers2.run(train, tiny_model, str(tmp_path / "full"), 2, 1, 4, _LORA, timeout_s=900)[0]
    cut = [*_LORA, "checkpoint.save_every=2"]
    workers2.run(train, tiny_model, str(tmp_path / "cut"), 2, 1, 2, cut, timeout_s=900)
    step = tmp_path / "cut" / "checkpoints" / "step-000002"
    keys = _checkpoint_keys(str(step))
    assert keys and all(k.startswith(("lora.", "optimizer.")) for k in keys), keys[:5]
    assert any(k.startswith("lora.decoder.layers.0.self_attention.linear_qkv.") for k in keys)
    resumed = workers2.run(train, tiny_model, str(tmp_path / "cut"), 2, 1, 4, cut, timeout_s=900)[0]
    assert [m["step"] for m in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):
        for key in (*COMPARED, "loss/kl_ref"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["step"], key)
    assert full[0]["loss/kl_ref"] == 0.0 and full[-1]["loss/kl_ref"] > 0  # step 1: the base is the policy, exactly
    # the run's exports: the merged model, and the adapter in PEFT's format
    config = json.loads((tmp_path / "full" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert (tmp_path / "full" / "hf" / "model.safetensors").is_file()

    other = tmp_path / "other_base"  # the same architecture, other weights
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    make_tiny_hf_model("qwen2", other, seed=6, vocab_size=1002)
    shutil.copytree(tmp_path / "cut", tmp_path / "cut2")
    with pytest.raises(Exception) as e:
        workers2.run(train, str(other), str(tmp_path / "cut2"), 2, 1, 4, cut, timeout_s=900)
    assert "its LoRA adapters were trained on the base" in str(e.value)
