"""Qwen3-MoE: the config is read into megatron's MoE settings (per-layer pattern from decoder_sparse_step and
mlp_only_layers, softmax top-k router in fp32, norm_topk_prob both ways); bad MoE configs get one line naming the
field; megatron log-probs equal transformers' Qwen3MoeForCausalLM (fp32, max relative <= 1e-5) at
(TP, PP, EP) = (1,1,1), (2,1,1) (ETP=2), (1,2,1), (1,1,2) and (2,1,2) (ETP=1), on 2 gloo processes."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.models import UnsupportedModelError, load_hf_config, transformer_config_from_hf
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
    cfg = make_tiny_hf_config("qwen3_moe", **overrides)
    hf = cfg.to_dict()
    hf["architectures"] = list(cfg.architectures)
    return hf


@pytest.mark.parametrize("norm", [True, False])
def test_moe_config_becomes_megatrons_moe_settings(norm):
    tcfg = transformer_config_from_hf(
        load_hf_config(_config(norm_topk_prob=norm, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    )
    assert tcfg.num_moe_experts == 8 and tcfg.moe_router_topk == 2 and tcfg.moe_ffn_hidden_size == 64
    # layer i is MoE when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert tcfg.moe_layer_freq == [0, 1, 0, 0, 0, 1]
    assert tcfg.moe_router_pre_softmax is (not norm) and tcfg.moe_router_score_function == "softmax"
    assert tcfg.moe_router_dtype == "fp32" and tcfg.qk_layernorm and tcfg.moe_aux_loss_coeff == 0.0


def test_released_spelling_num_experts_is_read():
    hf = _config()
    hf["num_experts"] = hf.pop("num_local_experts")
    assert transformer_config_from_hf(load_hf_config(hf)).num_moe_experts == 8


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [0, 1, 2, 3]}, "mlp_only_layers"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding"),
    ],
)
def test_bad_moe_config_is_one_line_naming_the_field(overrides, field):
    hf = _config()
    hf.update(overrides)
    with pytest.raises(UnsupportedModelError) as e:
        load_hf_config(hf)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_layout_that_does_not_divide_is_named():
    hf = load_hf_config(_config())
    with pytest.raises(ValueError, match="ep=3 must divide the model's num_experts=8"):
        transformer_config_from_hf(hf, ep=3)
    with pytest.raises(ValueError, match="etp=3 must divide the model's moe_intermediate_size=64"):
        transformer_config_from_hf(hf, etp=3)
    dense = make_tiny_hf_config("qwen2").to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        transformer_config_from_hf(load_hf_config(dense), ep=2)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("qwen3_moe")
    return {
        norm: str(make_tiny_hf_model("qwen3_moe", root / f"norm_{norm}", seed=31, norm_topk_prob=norm))
        for norm in (True, False)
    }


def _logits_worker(hf_dir: str, tp: int, pp: int, ep: int, etp: int | None, input_ids: torch.Tensor):
    from megatron_rlvr.runtime import distributed

    try:
        _, chunks = build_chunks(hf_dir, tp, pp, ep=ep, etp=etp)
        for chunk in chunks:  # megatron's MoE layer refuses TP > 1 without sequence parallelism in training mode only
            chunk.eval()
        return pipeline_logits(chunks, input_ids)
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "tp,pp,ep,etp", [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, 1), (2, 1, 2, 1)]
)
def test_moe_log_probs_match_transformers(workers2, moe_dirs, norm, tp, pp, ep, etp):
    hf_dir = moe_dirs[norm]
    vocab = load_hf_config(hf_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS)
    reference = hf_logits(hf_dir, ids, LENGTHS)
    outs = [r for r in workers2.run(_logits_worker, hf_dir, tp, pp, ep, etp, ids) if r is not None]
    assert outs, "no rank returned logits"
    rel = max(max_log_prob_rel_diff(o, reference, LENGTHS, vocab) for o in outs)
    print(
        f"qwen3_moe norm_topk_prob={norm} TP={tp} PP={pp} EP={ep} ETP={etp or tp}: max relative log-prob "
        f"difference vs transformers = {rel:.2e}"
    )
    assert rel <= REL_TOL


@pytest.mark.parametrize(
    "actor,world,message",
    [
        ({"ep": 3}, 6, "actor.ep=3 must divide the model's num_experts=8"),
        ({"ep": 4, "etp": 2}, 4, "actor.ep * actor.etp = 4 * 2 must divide dp * cp * tp = 4"),
        ({"tp": 2, "pp": 2, "ep": 2, "etp": 2}, 4, "actor.ep * actor.etp = 2 * 2 must divide dp * cp * tp = 2"),
        ({"etp": 3}, 3, "actor.etp=3 must divide the model's moe_intermediate_size=64"),
        ({"ep": 0}, 1, "actor.ep: must be >= 1"),
    ],
)
def test_config_validate_names_every_expert_layout_that_does_not_divide(actor, world, message):
    from megatron_rlvr.config import Config, ConfigError
    from megatron_rlvr.models.dims import ModelDims

    cfg = Config()
    for key, value in actor.items():
        setattr(cfg.actor, key, value)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=world, dims=ModelDims.from_hf(_config()))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_validate_refuses_expert_parallelism_for_a_dense_model_and_accepts_a_good_layout():
    from megatron_rlvr.config import Config, ConfigError
    from megatron_rlvr.models.dims import ModelDims

    cfg = Config()
    cfg.actor.ep = 2
    dense = make_tiny_hf_config("qwen3").to_dict()
    with pytest.raises(ConfigError, match="actor.ep=2.*dense model"):
        cfg.validate(world_size=2, dims=ModelDims.from_hf(dense))
    cfg.actor.tp, cfg.actor.etp, cfg.actor.sequence_parallel = 2, 1, True
    assert cfg.validate(world_size=4, dims=ModelDims.from_hf(_config()))
