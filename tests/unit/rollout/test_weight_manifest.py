"""Weight-stream checks without an engine: names and shapes from the checkpoint, tied lm_head, every problem named,
the stream always drained; RolloutConfig ranges; the CPU head-size check fires before any engine starts."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.rollout import RolloutConfig, WeightManifest, WeightSyncError
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
from tests.support.rollout.hf_reference import hf_state_dict, load_hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), max_shard_size="300KB")  # sharded + tied


@pytest.fixture(scope="module")
def llama_sd(llama_dir):
    return hf_state_dict(load_hf(llama_dir))


def test_manifest_reads_every_shard_and_adds_lm_head_for_tied_models(llama_dir, llama_sd):
    manifest = WeightManifest.from_model_dir(llama_dir)
    assert manifest.tied_embeddings
    assert "lm_head.weight" in manifest.shapes
    assert manifest.shapes == {name: tuple(t.shape) for name, t in llama_sd.items()}
    assert len(manifest.staged(llama_sd.items())) == len(llama_sd)


def test_staged_names_every_problem_and_drains_the_stream(llama_dir, llama_sd):
    manifest = WeightManifest.from_model_dir(llama_dir)
    consumed = []

    def stream():
        for name, tensor in llama_sd.items():
            consumed.append(name)
            if name == "model.layers.0.mlp.up_proj.weight":
                tensor = tensor.T
            if name == "model.layers.2.input_layernorm.weight":
                continue
            yield name, tensor
        yield "model.layers.9.mlp.up_proj.weight", torch.zeros(2)
        consumed.append("<end>")

    with pytest.raises(WeightSyncError) as info:
        manifest.staged(stream())
    message = str(info.value)
    assert "model.layers.0.mlp.up_proj.weight' has shape (128, 384), expected (384, 128)" in message
    assert "model.layers.9.mlp.up_proj.weight' is not a parameter" in message
    assert "missing tensors ['model.layers.2.input_layernorm.weight']" in message
    assert consumed[-1] == "<end>"  # a collective producer was run to its end


def test_tied_lm_head_must_be_sent_and_equal_the_embedding(llama_dir, llama_sd):
    manifest = WeightManifest.from_model_dir(llama_dir)
    without = [(k, v) for k, v in llama_sd.items() if k != "lm_head.weight"]
    with pytest.raises(WeightSyncError, match="missing tensors \\['lm_head.weight'\\].*stays stale"):
        manifest.staged(without)
    different = dict(llama_sd, **{"lm_head.weight": llama_sd["lm_head.weight"] * 2})
    with pytest.raises(WeightSyncError, match="differs from 'model.embed_tokens.weight'"):
        manifest.staged(different.items())


def test_non_float_and_non_pairs_are_refused(llama_dir, llama_sd):
    manifest = WeightManifest.from_model_dir(llama_dir)
    with pytest.raises(WeightSyncError, match="model.norm.weight.*dtype torch.int64"):
        manifest.check_tensor("model.norm.weight", torch.zeros(128, dtype=torch.int64))
    with pytest.raises(WeightSyncError, match="expected \\(hf_name, tensor\\) pairs"):
        manifest.staged([["model.norm.weight", llama_sd["model.norm.weight"]]])


@pytest.mark.parametrize(
    "key, value",
    [
        ("tp", 0),
        ("temperature", 0.0),
        ("top_p", 1.5),
        ("sleep_level", 3),
        ("sync_staging", "lazy"),
        ("min_new_tokens", 65),
    ],
)
def test_rollout_config_rejects_bad_values_naming_the_key(key, value):
    """Checked when a recipe loads: the fields' declared limits and the rules between them (megatron_rlvr/config)."""
    from megatron_rlvr.testing.configs import run_config

    with pytest.raises(ValueError, match=f"rollout.{key}"):
        run_config({"rollout.max_new_tokens": 64, f"rollout.{key}": value})


def test_cpu_engine_refuses_head_size_16_before_starting(tmp_path):
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "h16", head_dim=16)
    with pytest.raises(ValueError, match="head size 16.*supports head sizes \\[32, 64"):
        VLLMEngine(model_dir, RolloutConfig())
