"""The plan's mixture-of-experts and context-parallel terms (docs/plan.md): experts over EP x ETP, the router, the
dispatcher's buffers; per-CP-rank activations and logits, the optimizer over DP x CP; --suggest over ep and cp; and
`megatron-rlvr plan` refusing a bad MoE layout or model with one line naming the field. Pure arithmetic except the
two `dist` tests, which check the counts and bytes against megatron-core's build and a real MoE actor."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.command import main
from megatron_rlvr.plan.memory import FP32, Layout, plan_layout
from megatron_rlvr.plan.parallel_terms import dispatcher_bytes
from megatron_rlvr.plan.recipe_files import MODEL_CONFIGS_DIR, find_hf_config
from megatron_rlvr.plan.stage_params import stage_params, stage_split
from megatron_rlvr.plan.suggest import suggest
from tools.benches.measure_memory import Case, measure_rank, predicted

MOE = "Qwen3-30B-A3B"


def dims_of(model: str) -> ModelDims:
    return ModelDims.from_hf(find_hf_config(str(MODEL_CONFIGS_DIR / model)))


def components(dims: ModelDims, **layout) -> dict[str, int]:
    return plan_layout(dims, Layout(**layout), 141).ranks[0].components


def test_experts_divide_over_ep_and_etp_and_the_dense_part_over_tp():
    dims = dims_of(MOE)
    dense1, expert1 = stage_split(dims, 1, 1, 0)
    dense, expert = stage_split(dims, 1, 1, 0, ep=8, etp=2)
    assert dense == dense1 and expert * 16 == expert1
    assert expert1 == 48 * 128 * 3 * 2048 * 768  # 48 MoE layers of 128 experts, SwiGLU 2048 x 768, no bias
    assert stage_split(dims, 2, 1, 0)[1] == expert1  # TP does not cut the experts (ETP does)
    # the router is a dense parameter, [experts, hidden] per layer, beside attention and norms
    assert dense1 == 48 * (dims.attention_params(1) + 128 * 2048) + 2 * 151936 * 2048 + 2048


def test_optimizer_shards_dense_state_over_dp_x_cp_and_expert_state_over_expert_data_parallel():
    dims = dims_of(MOE)
    c = components(dims, tp=1, pp=1, dp=8, ep=8)
    dense, expert = stage_split(dims, 1, 1, 0, ep=8)
    assert c["actor_weights"] == 2 * (dense + expert) and c["actor_grads"] == 4 * (dense + expert)
    assert c["optimizer"] == 12 * (math.ceil(dense / 8) + expert)  # 8 ranks / (ep 8) = 1 expert-DP rank
    c2 = components(dims, tp=1, pp=1, dp=8, ep=4)
    assert c2["optimizer"] == 12 * (math.ceil(dense / 8) + math.ceil(2 * expert / 2))
    # CP: weights and grads whole on every CP rank, the distributed optimizer over DP x CP
    dense7 = dims_of("Qwen2.5-7B")
    cp1, cp2 = components(dense7, tp=1, pp=1, dp=4), components(dense7, tp=1, pp=1, dp=2, cp=2)
    assert cp1["actor_weights"] == cp2["actor_weights"] and cp1["actor_grads"] == cp2["actor_grads"]
    assert cp1["optimizer"] == cp2["optimizer"]


def test_cp_divides_the_activations_and_logits_and_adds_one_layers_gathered_kv():
    dims = dims_of("Qwen2.5-7B")
    whole = dict(tp=2, pp=1, dp=4, sequence_parallel=True, recompute="selective", max_seq_len=32768)
    cp1 = components(dims, **whole, micro_tokens=32768)
    cp4 = components(dims, **{**whole, "dp": 1}, cp=4, micro_tokens=8192)
    assert cp4["activations"] * 4 == pytest.approx(cp1["activations"], rel=1e-6)
    assert cp4["logits"] * 4 == cp1["logits"]
    assert cp1["cp_kv"] == 0 and cp4["cp_kv"] == 32768 * 2 * dims.kv_width // 2 * 2  # whole sequence, 1/tp of heads


def test_cp_on_cpu_keeps_local_queries_against_whole_sequence_scores():
    dims = dims_of("Qwen2.5-7B")
    lay = dict(tp=1, pp=1, dp=1, gpu=False, param_bytes=4, max_seq_len=4096)
    cp1 = components(dims, **lay, micro_tokens=4096)["activations"]
    cp2 = components(dims, **lay, cp=2, micro_tokens=2048)["activations"]
    assert cp2 * 2 == pytest.approx(cp1, rel=1e-9)  # t/2 queries x s keys per sequence: half the scores too


def test_moe_layers_keep_top_k_copies_and_the_dispatcher_holds_its_rows():
    dims = dims_of(MOE)
    lay = Layout(tp=1, pp=1, dp=8, ep=8, micro_tokens=8192)
    rows = 8192 * 8  # top-8 copies, balanced over EP
    assert dispatcher_bytes(dims, lay) == 4 * rows * 2048 * 2  # permuted, all-to-all'd, (ETP-gathered), sorted
    assert dispatcher_bytes(dims_of("Qwen2.5-7B"), lay) == 0
    c = plan_layout(dims, lay, 141).ranks[0]
    assert c.components["dispatcher"] > 0 and c.phases["update"] >= c.components["dispatcher"]
    # the experts' saved tensors grow with top_k: a top-1 model keeps less
    top1 = dataclasses.replace(dims, experts_per_token=1)
    assert plan_layout(top1, lay, 141).ranks[0].components["activations"] < c.components["activations"]
    per_row = (2048 + 5 * 768) * 2 + FP32
    assert c.components["activations"] > 48 * rows * per_row


def test_suggest_considers_ep_for_moe_and_cp_for_long_sequences():
    dims = dims_of(MOE)
    base = Layout(tp=1, pp=1, dp=8, recompute="full", micro_tokens=9216, max_seq_len=9216, micro_batches=4)
    rows = suggest(dims, base, 8, 8, 141)
    assert len({r.layout.ep for r in rows}) > 1
    assert all(r.plan.fits and dims.experts % r.layout.ep == 0 for r in rows)
    assert "actor.ep=" in " ".join(rows[0].overrides(True))
    long = Layout(tp=1, pp=1, dp=16, recompute="selective", micro_tokens=34816, max_seq_len=34816, micro_batches=8)
    picks = suggest(dims_of("DeepSeek-R1-Distill-Qwen-7B"), long, 16, 8, 141)
    assert {r.layout.cp for r in picks} >= {1, 2, 4}
    assert picks[0].layout.cp > 1 and "actor.cp=" in " ".join(picks[0].overrides(False))
    short = dataclasses.replace(long, micro_tokens=4096, max_seq_len=4096)
    assert {r.layout.cp for r in suggest(dims_of("DeepSeek-R1-Distill-Qwen-7B"), short, 16, 8, 141)} == {1}


def test_recipes_json_names_the_moe_and_cp_layouts(capsys):
    assert main(["qwen3-30b-a3b_math-l3to5_casp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["ep"] == 8 and out["components"]["dispatcher_gb"] > 0
    assert main(["deepseek-r1-distill-qwen-7b_code-32k_casp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["cp"] == 4 and out["components"]["cp_kv_gb"] > 0 and out["fits"]
    # the same recipe without CP does not fit at TP=1: one 34,816-token sequence's activations
    assert main(["deepseek-r1-distill-qwen-7b_code-32k_casp", "actor.cp=1", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["peak_gb"] > 141


# ---------------------------------------------------------------------------------------------------------------
# Bad MoE configs: one line naming the field, from `megatron-rlvr plan`


def _recipe_with_model(tmp_path: Path, hf_changes: dict, overrides: str = "") -> str:
    hf = find_hf_config(str(MODEL_CONFIGS_DIR / MOE)) | hf_changes
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf))
    recipe = Path("configs/qwen3-30b-a3b_math-l3to5_casp.yaml").read_text().replace("/models/Qwen3-30B-A3B", str(model))
    path = tmp_path / "moe.yaml"
    path.write_text(recipe)
    return str(path)


@pytest.mark.parametrize(
    "hf_changes,overrides,field",
    [
        ({}, ["actor.ep=3", "--nodes", "3"], "actor.ep=3 must divide the model's num_experts=128"),
        ({"num_experts": 96}, [], None),  # 96 / 8 divides: accepted
        ({"num_experts": 100}, [], "actor.ep=8 must divide the model's num_experts=100"),
        ({}, ["actor.etp=5", "--nodes", "5"], "actor.etp=5 must divide the model's moe_intermediate_size=768"),
        ({"scoring_func": "sigmoid"}, [], "scoring_func='sigmoid' is not supported"),
        ({"topk_method": "noaux_tc"}, [], "topk_method='noaux_tc' is not supported"),
        ({"shared_expert_intermediate_size": 768}, [], "shared_expert_intermediate_size=768 is not supported"),
        ({"n_shared_experts": 1}, [], "n_shared_experts=1 is not supported"),
        ({}, ["actor.tp=2"], "actor.sequence_parallel: must be true for a mixture-of-experts model at actor.tp=2"),
    ],
)
def test_plan_refuses_a_bad_moe_layout_or_model_in_one_line_naming_the_field(
    tmp_path, capsys, hf_changes, overrides, field
):
    recipe = _recipe_with_model(tmp_path, hf_changes)
    keys = [o for o in overrides if "=" in o]
    flags = [o for o in overrides if "=" not in o]
    code = main([recipe, *keys, *flags, "--json"])
    err = capsys.readouterr().err
    if field is None:
        assert code in (0, 3), err
        return
    assert code == 2, err
    assert field in err and err.count("\n") == 1, err


def test_plan_refuses_ep_on_a_dense_model_and_cp_that_does_not_divide(capsys):
    assert main(["qwen3-32b_math-l3to5_casp", "actor.ep=2"]) == 2
    assert "actor.ep=2" in capsys.readouterr().err
    assert main(["qwen2.5-32b_math-16k_casp", "actor.cp=3"]) == 2
    err = capsys.readouterr().err  # Config.validate's layout check names the product and its factors
    assert "actor.cp" in err and "4 * 1 * 3 = 12 must divide the world size 32; nearest layout that fits:" in err, err


# ---------------------------------------------------------------------------------------------------------------
# Against megatron-core (dist)


def _meta_moe_counts(model: str, ep: int) -> tuple[int, int]:
    """(this rank's parameter count, its pipeline stage) of ``model`` on the meta device at EP=ep."""
    import torch

    from megatron_rlvr.models import build_gpt_model, transformer_config_from_hf
    from megatron_rlvr.models import load_hf_config as load
    from megatron_rlvr.runtime import distributed

    with distributed.model_parallel(tp=1, pp=1, ep=ep, etp=1):
        hf = load(MODEL_CONFIGS_DIR / model)
        tcfg = transformer_config_from_hf(hf, ep=ep, etp=1, params_dtype=torch.bfloat16, perform_initialization=False)
        with torch.device("meta"):
            gpt = build_gpt_model(hf, tcfg)
        return sum(p.numel() for p in gpt.parameters())


@pytest.mark.dist
def test_moe_stage_params_equal_the_meta_device_build_at_ep2(workers2):
    counts = workers2.run(_meta_moe_counts, MOE, 2, timeout_s=600)
    assert counts[0] == counts[1] == stage_params(dims_of(MOE), 1, 1, 0, ep=2)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"), with_tokenizer=False))


@pytest.mark.dist
@pytest.mark.parametrize("ep,dist_opt", [(1, True), (2, True), (2, False)])
def test_predicted_moe_bytes_equal_the_measured_actor(workers2, tiny_moe, ep, dist_opt):
    case = Case(1, 1, distributed_optimizer=dist_opt, reference=not dist_opt, seq_len=16, ep=ep)
    measured = workers2.run(measure_rank, case, tiny_moe, warm_up=False)
    for rank, (m, p) in enumerate(zip(measured, predicted(case, tiny_moe, 2))):
        assert p["weights"] == m["weights"] and p["reference"] == m["reference"], (rank, p, m)
        assert m["grads"] >= p["grads"] and m["grads"] == pytest.approx(p["grads"], rel=0.02), (rank, p, m)
        assert m["optimizer"] == pytest.approx(p["optimizer"], rel=0.02), (rank, p, m)
        if not dist_opt:
            assert (m["grads"], m["optimizer"]) == (p["grads"], p["optimizer"]), "no padding without it"
