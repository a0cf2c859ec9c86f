"""The plan's arithmetic and command: parameter counts per rank, bytes by dtype and layout, the phases, the exit
statuses, --json and --suggest. Pure arithmetic: no process group, milliseconds."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan import command
from megatron_rlvr.plan.memory import GB, Layout, plan_layout
from megatron_rlvr.plan.recipe_files import MODEL_CONFIGS_DIR, find_hf_config
from megatron_rlvr.plan.stage_params import stage_params
from megatron_rlvr.plan.suggest import _rank, suggest
from tests.support.configs.model_sizes import KNOWN_SIZES, analytic_parameter_count

BIG = "qwen2.5-32b_math-l3to5_casp"


def dims_of(model: str) -> ModelDims:
    return ModelDims.from_hf(find_hf_config(str(MODEL_CONFIGS_DIR / model)))


@pytest.mark.parametrize("model", sorted(KNOWN_SIZES))
def test_stage_counts_add_up_to_the_models_count(model):
    hf = find_hf_config(str(MODEL_CONFIGS_DIR / model))
    dims = ModelDims.from_hf(hf)
    whole = stage_params(dims, tp=1, pp=1, stage=0)
    padding = (-dims.vocab % 128) * dims.hidden * (1 if dims.tied else 2)  # megatron pads the vocab rows
    assert whole == analytic_parameter_count(hf) + padding
    assert dims.hf_params() == analytic_parameter_count(hf)
    # pipeline stages split the layers; a tied model's last stage holds its own output layer
    split = stage_params(dims, 1, 2, 0) + stage_params(dims, 1, 2, 1)
    assert split == whole + (dims.hidden * -(-dims.vocab // 128) * 128 if dims.tied else 0)


def test_bytes_follow_the_dtype_and_the_distributed_optimizer():
    dims = dims_of("Qwen2.5-7B")
    gpu = Layout(tp=2, pp=1, dp=4, param_bytes=2)
    n = stage_params(dims, 2, 1, 0)
    c = plan_layout(dims, gpu, 141).ranks[0].components
    assert (c["actor_weights"], c["actor_grads"]) == (2 * n, 4 * n)  # bf16 params, fp32 main grads
    assert c["optimizer"] == 12 * -(-n // 4)  # fp32 main params + Adam m, v over DP
    assert c["reference"] == 0
    cpu = dataclasses.replace(gpu, param_bytes=4, distributed_optimizer=False, reference=True, gpu=False)
    c = plan_layout(dims, cpu, 141).ranks[0].components
    assert (c["actor_weights"], c["optimizer"], c["reference"]) == (4 * n, 8 * n, 4 * n)  # fp32: its own main params
    assert c["engine_weights"] == c["kv_cache"] == c["runtime"] == 0


def test_activations_shrink_with_recompute_and_sequence_parallel():
    dims = dims_of("Qwen2.5-7B")
    base = Layout(tp=2, pp=1, dp=4, micro_tokens=4096, max_seq_len=4096)

    def act(**kw):
        return plan_layout(dims, dataclasses.replace(base, **kw), 141).ranks[0].components["activations"]

    assert act(recompute="full") < act(recompute="selective", sequence_parallel=True) < act(recompute="selective")
    assert act(micro_tokens=8192) == pytest.approx(2 * act(), rel=1e-3)
    # 1F1B: the first stage holds pp micro-batches in flight, the last one
    pp = dataclasses.replace(base, pp=2, micro_batches=8)
    ranks = plan_layout(dims, pp, 141).ranks
    per_layer_stage0 = ranks[0].components["activations"]
    assert per_layer_stage0 == pytest.approx(act(), rel=0.01)  # 2 in flight x half the layers


def test_colocated_engine_sleeps_and_separate_engines_have_their_own_ranks():
    dims = dims_of("Qwen2.5-7B")
    lay = Layout(tp=2, pp=1, dp=4, engine_tp=2, gpu_memory_utilization=0.45)
    (actor,) = plan_layout(dims, lay, 141).ranks
    c, ph = actor.components, actor.phases
    assert c["engine_weights"] + c["kv_cache"] + c["engine_workspace"] == int(0.45 * 141 * GB)
    assert ph["rollout"] - ph["statistics"] == pytest.approx(
        c["engine_weights"] + c["kv_cache"] - c["forward_working"] - c["logits"] - c["op_scratch"], abs=1
    )
    separate = plan_layout(dims, dataclasses.replace(lay, placement="separate", engine_ranks=4), 141)
    assert [r.name for r in separate.ranks] == ["actor", "engine rank"]
    assert separate.ranks[0].components["engine_weights"] == 0
    assert separate.ranks[1].peak == int(0.45 * 141 * GB) + separate.ranks[0].components["runtime"]


def test_layout_reads_knobs_that_other_issues_add_with_their_defaults():
    from megatron_rlvr.config import load_config
    from megatron_rlvr.plan.recipe_files import find_recipe

    cfg = load_config(find_recipe(BIG))
    lay = Layout.from_config(cfg, 32)
    assert (lay.tp, lay.dp, lay.placement, lay.engine_ranks, lay.micro_tokens) == (8, 4, "colocated", 0, 5120)
    fake = SimpleNamespace(
        **{k: getattr(cfg, k) for k in ("model", "algo", "trainer")},
        actor=SimpleNamespace(**{**vars(cfg.actor), "max_tokens_per_micro_batch": 16384}),
        rollout=SimpleNamespace(**{**vars(cfg.rollout), "placement": "separate", "engine_ranks": 8}),
    )
    lay = Layout.from_config(fake, 32)
    assert (lay.dp, lay.placement, lay.engine_ranks, lay.micro_tokens) == (3, "separate", 8, 16384)


def test_the_32b_recipe_fits_and_at_tp1_does_not_naming_the_grads(capsys):
    assert command.main([BIG]) == 0
    assert "fits" in capsys.readouterr().out
    assert command.main([BIG, "actor.tp=1", "actor.sequence_parallel=false"]) == 3
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "breaks it: actor_grads" in out


def test_json_has_the_documented_keys(capsys):
    assert command.main([BIG, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and 0 < plan["peak_gb"] <= 141
    assert set(plan["phases"]) == {"rollout", "statistics", "update", "sync"}
    assert plan["peak_gb"] == max(plan["phases"].values())
    for key in (
        "actor_weights_gb",
        "actor_grads_gb",
        "optimizer_gb",
        "activations_gb",
        "reference_gb",
        "engine_weights_gb",
        "kv_cache_gb",
    ):
        assert key in plan["components"], key
    assert plan["components"]["actor_weights_gb"] == pytest.approx(32.76e9 / 8 * 2 / 1e9, rel=0.01)


@pytest.mark.parametrize(
    "args, message",
    [
        (["no_such_recipe"], "known recipes"),
        ([BIG, "actor.tp=3"], "actor.tp"),
        ([BIG, "algo.loss.alpha=lots"], "algo.loss.alpha"),
        ([BIG, "--nodes", "0"], "--nodes"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert command.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_tiny_kv_cache_is_a_problem_even_when_the_bytes_add_up(capsys):
    assert command.main([BIG, "rollout.gpu_memory_utilization=0.13", "--json"]) == 3
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and "kv_cache" in plan["problems"][0]


def test_suggest_lists_fitting_layouts_best_first(capsys):
    hf = find_hf_config(str(MODEL_CONFIGS_DIR / "Qwen2.5-32B"))
    from megatron_rlvr.config import load_config
    from megatron_rlvr.plan.recipe_files import find_recipe

    base = Layout.from_config(load_config(find_recipe(BIG)), 32)
    rows = suggest(ModelDims.from_hf(hf), base, 32, 8, 141)
    assert rows and all(r.plan.fits for r in rows)
    assert [_rank(r) for r in rows] == sorted(_rank(r) for r in rows)
    assert all(r.layout.tp * r.layout.pp > 1 for r in rows)  # 32B needs model parallelism on 141 GB
    assert command.main([BIG, "--suggest", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best first by" in out and out.count("actor.tp=") == 3
