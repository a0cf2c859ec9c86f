"""Every recipe in configs/ loads, validates at the world size its header documents, and names a real model.

The models of the paper recipes are built on the meta device (no memory) through megatron_rlvr.models, and their
parameter counts must match the published sizes within 1%.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.recipes import CONFIGS_DIR, MODEL_CONFIGS_DIR, find_hf_config, find_recipe, load_and_validate, recipe_names
from megatron_rlvr.errors import ConfigError
from tests.support.configs.model_sizes import ACTIVE_SIZES, KNOWN_SIZES, analytic_parameter_count

CPU_RECIPES = {
    "demo_cpu",
    "demo_cpu_grpo",
    "eval_cpu",
    "reasoning_gym_cpu",
    "smollm2-135m-instruct_arithmetic_casp_cpu",
    "smollm2-135m-instruct_arithmetic_grpo_cpu",
}
PAPER_RECIPES = sorted(set(recipe_names()) - CPU_RECIPES)


def documented_world_size(name: str) -> int:
    """The world size of the launch command in the recipe's header: --nodes N x 8 H200s, or local processes.
    Evaluation runs one vLLM engine: its rollout.tp ranks on a cluster, one process on CPU."""
    text = find_recipe(name).read_text()
    if name.startswith("eval_"):
        return 1 if name in CPU_RECIPES else load_and_validate(name, [], world_size=None)[1].rollout.tp
    nodes = re.search(r"--executor slurm_h200 --nodes (\d+)", text)
    if nodes:
        return int(nodes.group(1)) * 8
    nproc = re.search(r"--nproc-per-node (\d+)", text)
    return int(nproc.group(1)) if nproc else 2  # the local executor's default: 2 processes


def test_the_paper_and_cpu_recipes_are_all_there():
    names = set(recipe_names())
    assert names >= CPU_RECIPES
    for model in KNOWN_SIZES:
        assert any(load_hf_config_of(n).get("_name") == model for n in PAPER_RECIPES), f"no recipe trains/evals {model}"
    assert "eval_k1024_qwen2.5-math-7b" in names


def load_hf_config_of(name: str) -> dict:
    _, cfg = load_and_validate(name, [], world_size=None)
    hf = find_hf_config(cfg.model.hf_dir) or {}
    return {**hf, "_name": Path(cfg.model.hf_dir).name}


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_loads_and_validates_at_its_documented_world_size(name):
    world = documented_world_size(name)
    _, cfg = load_and_validate(name, [], world_size=world, require_model=name not in CPU_RECIPES)
    assert world % (cfg.actor.tp * cfg.actor.pp) == 0
    if name not in CPU_RECIPES:
        assert cfg.model.hf_dir.startswith("/models/"), "cluster recipes read checkpoints from the /models mount"
        hf = find_hf_config(cfg.model.hf_dir)
        assert cfg.rollout.max_model_len <= hf["max_position_embeddings"], "responses must fit the model's positions"
        assert hf["num_attention_heads"] % cfg.rollout.tp == 0 and hf["num_key_value_heads"] % cfg.rollout.tp == 0


@pytest.mark.parametrize(
    "name",
    [n for n in PAPER_RECIPES if n.endswith("_casp")] + ["demo_cpu", "smollm2-135m-instruct_arithmetic_casp_cpu"],
)
def test_casp_recipes_use_the_papers_candidate_count(name):
    _, cfg = load_and_validate(name, [], world_size=None)
    assert cfg.algo.loss.kind == "casp" and cfg.algo.loss.top_n == 3 and cfg.algo.loss.apply_to == "both"
    if name != "demo_cpu":  # the demo's alpha (0.2) is ours, chosen on held-out prompts (docs/demo.md)
        assert 0 < cfg.algo.loss.alpha <= 0.1, "inside the paper's alpha sweep"
    assert cfg.algo.loss.alpha > 0


def test_eval_recipes_use_the_papers_sample_counts():
    evals = [n for n in PAPER_RECIPES if n.startswith("eval_")]
    counts = {n: load_and_validate(n, [], world_size=None)[1].eval.n_samples for n in evals}
    assert counts["eval_qwen2.5-32b_math"] == 128
    assert counts["eval_k1024_qwen2.5-math-7b"] == 1024
    others = {n: c for n, c in counts.items() if n not in ("eval_qwen2.5-32b_math", "eval_k1024_qwen2.5-math-7b")}
    assert others and set(others.values()) <= {256, 300}, others


def test_a_bad_override_or_layout_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="algo.loss.alpha"):
        load_and_validate("qwen2.5-32b_math-l3to5_casp", ["algo.loss.alpha=lots"], world_size=32)
    with pytest.raises(ConfigError, match="actor.tp=8 must divide the model.s num_attention_heads=28"):
        load_and_validate("qwen2.5-math-7b_math-l3to5_casp", ["actor.tp=8"], world_size=8)
    with pytest.raises(ConfigError, match="world size 12"):
        load_and_validate("qwen2.5-32b_math-l3to5_casp", [], world_size=12)
    with pytest.raises(ConfigError, match="known recipes: .*demo_cpu"):
        find_recipe("no_such_recipe")


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize("model", sorted(KNOWN_SIZES))
def test_analytic_parameter_count_matches_the_published_size(model):
    hf = find_hf_config(f"/models/{model}")
    count = analytic_parameter_count(hf)
    assert abs(count - KNOWN_SIZES[model]) / KNOWN_SIZES[model] < 0.01, (model, count)
    if model in ACTIVE_SIZES:
        from megatron_rlvr.models.dims import ModelDims

        active = ModelDims.from_hf(hf).active_params()
        assert abs(active - ACTIVE_SIZES[model]) / ACTIVE_SIZES[model] < 0.02, (model, active)


def _meta_parameter_counts(models: list[str]) -> dict[str, int]:
    """Runs on a 1-process gloo worker: build each model on the meta device and count its parameters."""
    import torch

    from megatron_rlvr.models import build_gpt_model, load_hf_config, transformer_config_from_hf
    from megatron_rlvr.runtime import distributed

    counts = {}
    with distributed.model_parallel(tp=1, pp=1):
        for model in models:
            hf = load_hf_config(MODEL_CONFIGS_DIR / model)
            tcfg = transformer_config_from_hf(hf, tp=1, pp=1, params_dtype=torch.bfloat16, perform_initialization=False)
            with torch.device("meta"):
                gpt = build_gpt_model(hf, tcfg)
            assert {p.device.type for p in gpt.parameters()} == {"meta"}, f"{model}: parameters left the meta device"
            counts[model] = sum(p.numel() for p in gpt.parameters())
    return counts


def test_megatron_model_on_meta_device_matches_the_published_size():
    from megatron_rlvr.testing.workers import WorkerGroup

    with WorkerGroup(1, timeout_s=600) as group:
        (counts,) = group.run(_meta_parameter_counts, sorted(KNOWN_SIZES))
    for model, count in counts.items():
        hf = find_hf_config(f"/models/{model}")
        print(f"{model}: megatron meta build {count / 1e9:.3f}B params, published {KNOWN_SIZES[model] / 1e9:.2f}B")
        assert count == analytic_parameter_count(hf), model
        assert abs(count - KNOWN_SIZES[model]) / KNOWN_SIZES[model] < 0.01, (model, count)


def test_every_kept_model_config_is_referenced_by_a_recipe():
    kept = {p.parent.name for p in MODEL_CONFIGS_DIR.glob("*/config.json")}
    used = {load_hf_config_of(n)["_name"] for n in PAPER_RECIPES}
    assert kept == used == set(KNOWN_SIZES)
    assert CONFIGS_DIR.is_dir()


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_benchmarks_are_ones_the_eval_runner_knows(name):
    from megatron_rlvr.problems.benchmarks import BENCHMARKS

    _, cfg = load_and_validate(name, [], world_size=None)
    assert set(cfg.eval.benchmarks) <= set(BENCHMARKS), sorted(set(cfg.eval.benchmarks) - set(BENCHMARKS))
    if name.startswith("eval_"):
        assert cfg.eval.benchmarks, "an eval recipe names its benchmarks"


# ---------------------------------------------------------------------------------------------------------------
# Memory plan and data lines of the GPU training recipes

GPU_TRAIN_RECIPES = [n for n in PAPER_RECIPES if not n.startswith("eval_")]


@pytest.mark.parametrize("name", GPU_TRAIN_RECIPES)
def test_gpu_recipe_fits_its_nodes_and_its_header_carries_the_plan(name):
    from megatron_rlvr.plan.command import header_lines, load_plan_inputs, make_plan

    assert documented_world_size(name) % 8 == 0, "a GPU recipe's header names its --executor slurm_h200 --nodes N"
    cfg, hf, nodes = load_plan_inputs(name, [], None, 8)
    assert nodes * 8 == documented_world_size(name)
    plan = make_plan(cfg, hf, nodes)
    assert plan.fits, (name, plan.peak / 1e9, plan.problems)
    header = find_recipe(name).read_text()
    for line in header_lines(plan):
        assert f"#   {line}\n" in header, f"{name}: the header's plan is stale; print it with megatron-rlvr plan {name}"
    data = re.search(r"^# data: megatron-rlvr data prepare (\S+) .*--out (\S+)$", header, re.MULTILINE)
    assert data and data.group(2) == cfg.data.path, f"{name}: a '# data:' line making {cfg.data.path}"
