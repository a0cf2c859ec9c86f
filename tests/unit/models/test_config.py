"""HF config -> megatron-core mapping: the supported families map field by field; anything that would silently
change the math (sliding window in use, unknown rope type, llama3 constants megatron does not use, non-SwiGLU,
biases Llama lacks) is refused with an error naming the file and field."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rlvr.models import UnsupportedModelError, load_hf_config, padded_vocab_size
from megatron_rlvr.models.family import rope_settings
from megatron_rlvr.testing.tiny_models import TINY_DEFAULTS, make_tiny_hf_config


def _hf(arch: str, **overrides) -> dict:
    cfg = make_tiny_hf_config(arch, **overrides).to_dict()
    cfg["architectures"] = TINY_DEFAULTS[arch]["architectures"]
    return cfg


def test_loads_from_dir_file_and_dict(tmp_path):
    cfg = _hf("qwen2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(tmp_path)["vocab_size"] == 1001
    assert load_hf_config(tmp_path / "config.json")["hidden_size"] == 128
    assert load_hf_config(cfg)["num_key_value_heads"] == 2
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        load_hf_config(tmp_path / "missing_dir")


def test_legacy_rope_fields_are_read():
    legacy = {"rope_theta": 1e6, "rope_scaling": None}
    assert rope_settings(legacy) == {"rope_type": "default", "rope_theta": 1e6}
    llama31 = {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert rope_settings(llama31)["factor"] == 8.0 and rope_settings(llama31)["rope_theta"] == 5e5


@pytest.mark.parametrize(
    "arch,overrides,needle",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, "sliding-window"),
        (
            "qwen2",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
            "rope_type='yarn'",
        ),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "low_freq_factor",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_math_changing_fields_are_refused(tmp_path, arch, overrides, needle):
    (tmp_path / "config.json").write_text(json.dumps(_hf(arch, **overrides)))
    with pytest.raises(UnsupportedModelError) as e:
        load_hf_config(tmp_path)
    assert needle in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_sliding_window_declared_but_unused_is_fine():
    # Qwen2.5 checkpoints carry sliding_window with use_sliding_window=false: full attention everywhere.
    assert load_hf_config(_hf("qwen2", sliding_window=4096, use_sliding_window=False))


def test_unknown_architecture_is_refused():
    cfg = _hf("llama")
    cfg["architectures"] = ["MistralForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        load_hf_config(cfg)


def test_padded_vocab_size_follows_megatron():
    assert padded_vocab_size(1001, 1) == 1024
    assert padded_vocab_size(1001, 2) == 1024
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2.5: already a multiple of 128
    assert padded_vocab_size(151936, 2) == 152064  # but not of 256
    assert padded_vocab_size(128256, 8, divisible_by=64) == 128512


def test_transformer_config_fields():
    from megatron_rlvr.models import transformer_config_from_hf

    q = transformer_config_from_hf(load_hf_config(_hf("qwen2")), tp=2, recompute="selective")
    assert (q.add_qkv_bias, q.add_bias_linear, q.gated_linear_unit, q.normalization) == (True, False, True, "RMSNorm")
    assert (q.num_query_groups, q.kv_channels, q.ffn_hidden_size, q.layernorm_epsilon) == (2, 32, 256, 1e-6)
    assert q.tensor_model_parallel_size == 2 and q.recompute_granularity == "selective"
    assert q.activation_func is torch.nn.functional.silu
    llama = transformer_config_from_hf(load_hf_config(_hf("llama")), pp=2, params_dtype=torch.bfloat16)
    assert (llama.add_qkv_bias, llama.layernorm_epsilon, llama.bf16, llama.pipeline_model_parallel_size) == (
        False,
        1e-5,
        True,
        2,
    )
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        transformer_config_from_hf(load_hf_config(_hf("llama")), tp=4)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        transformer_config_from_hf(load_hf_config(_hf("llama")), pp=3)
