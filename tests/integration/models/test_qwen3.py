"""Qwen3 dense: the config is read (q/k norms, explicit head_dim, no biases) and math-changing fields are refused
with one line naming the field; megatron log-probs equal transformers' Qwen3ForCausalLM (fp32, max relative
<= 1e-5) at (TP, PP) = (1,1), (2,1), (1,2)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.models import UnsupportedModelError, load_hf_config
from megatron_rlvr.testing.tiny_models import make_tiny_hf_config
from tests.integration.models.mp_helpers import (
    build_chunks,
    hf_logits,
    max_log_prob_rel_diff,
    pipeline_logits,
    varied_batch,
)

LENGTHS = [5, 16, 11]
REL_TOL = 1e-5


def _config(**overrides) -> dict:
    cfg = make_tiny_hf_config("qwen3", **overrides)
    hf = cfg.to_dict()
    hf["architectures"] = list(cfg.architectures)
    return hf


def test_qwen3_config_reads_qk_norm_and_head_dim():
    from megatron_rlvr.models import transformer_config_from_hf

    tcfg = transformer_config_from_hf(load_hf_config(_config()))
    assert tcfg.qk_layernorm and not tcfg.add_qkv_bias
    assert tcfg.kv_channels == 64 and tcfg.hidden_size // tcfg.num_attention_heads == 32


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding"),
        ({"attention_bias": True}, "attention_bias"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 1024,
                }
            },
            "rope_type",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_qwen3_refuses_math_changing_fields_in_one_line(overrides, field):
    with pytest.raises(UnsupportedModelError) as e:
        load_hf_config(_config(**overrides))
    assert field in str(e.value) and "\n" not in str(e.value)


def _logits_worker(hf_dir: str, tp: int, pp: int, input_ids: torch.Tensor):
    from megatron_rlvr.runtime import distributed

    try:
        _, chunks = build_chunks(hf_dir, tp, pp)
        return pipeline_logits(chunks, input_ids)
    finally:
        distributed.destroy_model_parallel()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3", seed=21))


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_qwen3_log_probs_match_transformers(workers2, qwen3_dir, tp, pp):
    vocab = load_hf_config(qwen3_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS)
    reference = hf_logits(qwen3_dir, ids, LENGTHS)
    outs = [r for r in workers2.run(_logits_worker, qwen3_dir, tp, pp, ids) if r is not None]
    assert outs, "no rank returned logits"
    rel = max(max_log_prob_rel_diff(o, reference, LENGTHS, vocab) for o in outs)
    print(f"qwen3 TP={tp} PP={pp}: max relative log-prob difference vs transformers = {rel:.2e}")
    assert rel <= REL_TOL
