"""The plan's host-memory table: every H200 training recipe names its node's host memory, fits it and carries the
current host line in its header; the staging arithmetic equals what `ShardStage` keeps; the settings move the
components they should; `plan` exits 3 naming the component when a node's host memory does not fit. On CPU: lent
tensors (colocated, actor TP > 1) count two whole-model lending slots per TP group and no engine buffer, fresh ones
(actor TP 1) the direct loader's second buffer; the engine's own bytes after a lent sync are the checkpoint's plain
tensors."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.command import load_plan_inputs, main, make_plan
from megatron_rlvr.plan.host_memory import (
    GB,
    engine_plain_bytes,
    engine_weight_bytes,
    host_header_line,
    host_plan,
    staged_bytes,
)
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
        staged = ShardStage(manifest, ModelDims.from_hf(hf), tp, tp - 1).stage(iter(weights))
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


# The demo's layout with the larger CPU model of docs/weight-sync.md's validation (a 623 MB fp32 Qwen2)
LARGER_QWEN2 = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)


def _cpu_host(overrides: list[str] = (), hf_overrides: dict | None = None, world: int = 2):
    from megatron_rlvr.config import load_config
    from megatron_rlvr.plan.memory import Layout
    from megatron_rlvr.plan.recipe_files import find_hf_config

    cfg = load_config("configs/demo_cpu.yaml", list(overrides))
    hf = {**find_hf_config(cfg.model.hf_dir), **(hf_overrides or {})}
    lay = Layout.from_config(cfg, world, gpu=False)
    return host_plan(cfg, hf, lay, world, world, 0), ModelDims.from_hf(hf), cfg


def test_cpu_lent_layout_counts_two_whole_model_slots_and_no_engine_buffer():
    lent, dims, cfg = _cpu_host(hf_overrides=LARGER_QWEN2)
    model = engine_weight_bytes(dims, 1, 4)
    kv = cfg.rollout.kv_cache_memory_bytes
    assert lent.components["staging"] == 0  # the engines compute on the held slot
    # later syncs: both whole-call slots of the one TP group written (shared by its ranks), plus the exchange
    assert 2 * model < lent.components["transfer_buckets"] <= 2 * model + 2 * 2 * (64 << 20)  # 2 slots per rank
    assert lent.components["engine"] == 2 * (engine_plain_bytes(dims) + kv) < 2 * (model + kv)
    assert any("both lending slots" in n for n in lent.notes)
    # the slots hold whole calls, not buckets: the bucket size does not move them
    small = _cpu_host(["rollout.bucket_bytes=1048576"], LARGER_QWEN2)[0]
    assert small.components["transfer_buckets"] == lent.components["transfer_buckets"]
    # fresh tensors (actor TP 1: no lending): the direct loader's second buffer per engine, the engine's whole model
    fresh = _cpu_host(["actor.tp=1"], LARGER_QWEN2)[0]
    assert fresh.components["staging"] == 2 * model and fresh.components["transfer_buckets"] == 0
    assert fresh.components["engine"] == 2 * (model + kv)
    # streaming staging: vLLM's own reload, nothing adopted
    streaming = _cpu_host(["rollout.sync_staging=streaming"], LARGER_QWEN2)[0]
    assert streaming.components["staging"] == 0 and streaming.components["engine"] == 2 * (model + kv)
    assert (
        _cpu_host(["trainer.save_hf=false"], LARGER_QWEN2)[0].components["hf_export"]
        == 0
        < lent.components["hf_export"]
    )


def test_cpu_first_sync_is_the_peak_when_several_engines_load_a_model_of_little_plain_parameters():
    # 4 engines in one TP group, a small vocabulary: before the first commit their 4 loaded copies outweigh the
    # second slot and the exchange that later syncs add (the end-of-run export off)
    narrow = dict(LARGER_QWEN2, vocab_size=1024)
    plan, dims, cfg = _cpu_host(["actor.tp=4", "trainer.save_hf=false"], narrow, world=4)
    model = engine_weight_bytes(dims, 1, 4)
    assert any("first weight sync" in n for n in plan.notes)
    assert plan.components["engine"] == 4 * (model + cfg.rollout.kv_cache_memory_bytes)
    assert plan.components["transfer_buckets"] == 4 * (model // 4) and plan.components["hf_export"] == 0
    # with the vocabulary of the validation run the twins of its tables make the later syncs the peak
    assert any("both lending slots" in n for n in _cpu_host(["actor.tp=4"], LARGER_QWEN2, world=4)[0].notes)


def test_the_engine_plain_bytes_are_the_checkpoints_plain_tensors(tmp_path):
    """A lent-fed engine keeps, of its own, each tensor that is not a GEMM weight once (the twin of an adopted view)
    and the packed biases (and a padded vocabulary's tables) twice: live and twin (rollout/cpu/weights.py)."""
    from megatron_rlvr.bridge import HFCheckpointReader
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    for vocab in (1001, 1024):  # padded to a multiple of 64 by vLLM, or not
        hf_dir = make_tiny_hf_model("qwen2", tmp_path / str(vocab), vocab_size=vocab, with_tokenizer=False)
        with HFCheckpointReader(hf_dir) as reader:
            sizes = {n: reader.read(n).numel() * 4 for n in reader.names()}
        plain = {n: b for n, b in sizes.items() if not n.endswith("proj.weight")}
        twice = {n: b for n, b in plain.items() if n.endswith("bias") or (vocab % 64 and "norm" not in n)}
        assert engine_plain_bytes(ModelDims.from_hf(load_hf_config(hf_dir))) == sum(plain.values()) + sum(
            twice.values()
        )
