"""The plan's host-memory table: every H200 training recipe names its node's host memory, fits it and carries the
current host line in its header; the staging arithmetic equals what `ShardStage` keeps; the settings move the
components they should; `plan` exits 3 naming the component when a node's host memory does not fit."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.plan.command import load_plan_inputs, main, make_plan
from megatron_rlvr.plan.host_memory import GB, host_header_line, host_plan, staged_bytes
from megatron_rlvr.plan.model_dims import ModelDims
from megatron_rlvr.plan.recipe_files import find_recipe, recipe_names

H200_TRAIN = [
    n for n in recipe_names() if not n.startswith("eval_") and "--executor slurm_h200" in find_recipe(n).read_text()
]


def _host(name: str, overrides: list[str] = (), host_gb: float | None = None):
    cfg, hf, nodes = load_plan_inputs(name, list(overrides), None, 8)
    plan = make_plan(cfg, hf, nodes)
    return host_plan(cfg, hf, plan.layout, nodes * 8, 8, cfg.cluster.host_memory_gb if host_gb is None else host_gb)


@pytest.mark.parametrize("name", H200_TRAIN)
def test_h200_recipes_name_their_host_memory_fit_it_and_carry_the_host_line(name):
    cfg, _, _ = load_plan_inputs(name, [], None, 8)
    assert cfg.cluster.host_memory_gb == 2000  # a DGX H200 node
    host = _host(name)
    assert host.fits, (name, host.total / GB)
    assert f"#   {host_header_line(host)}\n" in find_recipe(name).read_text(), f"{name}: stale host line"


def test_staging_follows_the_setting_and_the_engine_tp_and_sleep_level_moves_the_offload():
    name = "qwen2.5-32b_math-l3to5_casp"
    full, streaming = _host(name), _host(name, ["rollout.sync_staging=streaming"])
    assert streaming.components["staging"] == 0 and full.components["staging"] > 0
    tp8 = _host(name, ["rollout.tp=8"])
    assert tp8.components["staging"] < 0.6 * full.components["staging"]
    assert _host(name, ["rollout.sleep_level=2"]).components["sleep_offload"] == 0
    assert full.components["sleep_offload"] > 0


def test_the_staging_arithmetic_is_what_the_shard_stage_keeps(tmp_path):
    import torch

    from megatron_rlvr.bridge import HFCheckpointReader
    from megatron_rlvr.bridge.mapping import ModelDims as BridgeDims
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.rollout.shard_stage import ShardStage
    from megatron_rlvr.rollout.weight_manifest import WeightManifest
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    hf_dir = make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=1024)
    hf = load_hf_config(hf_dir)
    with HFCheckpointReader(hf_dir) as reader:
        weights = [(n, reader.read(n)) for n in reader.names()]
    manifest = WeightManifest.from_model_dir(hf_dir)
    for tp in (1, 2):
        staged = ShardStage(manifest, BridgeDims.from_hf(hf), tp, tp - 1).stage(iter(weights))
        assert staged.peak_bytes == staged_bytes(ModelDims.from_hf(hf), tp, torch.float32.itemsize)


def test_plan_exits_3_naming_the_component_when_host_memory_does_not_fit(capsys):
    name = "qwen2.5-32b_math-l3to5_casp"
    assert main([name, "--json"]) == 0
    capsys.readouterr()
    assert main([name, "rollout.sleep_level=2", "--host-memory-gb", "200"]) == 3
    out = capsys.readouterr().out
    assert "host: " in out and "does NOT fit" in out and "breaks it: staging" in out
    assert main([name, "rollout.sleep_level=2", "--host-memory-gb", "200", "--json"]) == 3
    got = json.loads(capsys.readouterr().out)
    assert got["gpu_fits"] and not got["fits"] and got["host"]["breaking_component"]["name"] == "staging"
    assert main([name, "--host-memory-gb", "-1"]) == 2
