"""The plan's LoRA terms (plan/lora_terms.py): the adapter an engine serves counted two ways (the plan's arithmetic
and the engine's expected PEFT tensors), the per-rank adapters against the same model's layout, and what LoRA changes
in a plan: no base grads or optimizer, the reference free, the 32B recipe on one node."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.lora import TARGETS, AdapterSpec
from megatron_rlvr.plan.lora_terms import adapter_hf_params, adapter_split
from megatron_rlvr.plan.memory import Layout, actor_static
from megatron_rlvr.rollout.lora_adapters import expected_tensors
from megatron_rlvr.testing.tiny_models import make_tiny_hf_config


def _dims(arch: str) -> ModelDims:
    return ModelDims.from_hf(make_tiny_hf_config(arch).to_dict())


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("rank", [1, 8])
def test_the_served_adapter_is_counted_alike_by_the_plan_and_the_engine(arch, rank):
    dims = _dims(arch)
    targets = tuple(t for t in TARGETS if t != "experts")
    served = sum(math.prod(s) for s in expected_tensors(dims, AdapterSpec(rank, 16.0, targets=targets)).values())
    assert adapter_hf_params(dims, rank, targets) == served


def test_rank_adapters_are_the_served_adapter_less_the_shared_a_copies_and_split_over_tp():
    dims, r = _dims("qwen2"), 4
    lay = Layout(tp=1, pp=1, dp=1, lora_rank=r, lora_targets=tuple(TARGETS))
    dense, expert = adapter_split(dims, lay, 0)
    # PEFT repeats a fused linear's A per module: q, k, v share one (2 extra), gate and up one (1 extra)
    assert expert == 0 and dense == adapter_hf_params(dims, r, lay.lora_targets) - dims.layers * 3 * r * dims.hidden
    tp2 = sum(adapter_split(dims, dataclasses.replace(lay, tp=2), 0))
    whole = dims.layers * r * (dims.hidden + dims.hidden + dims.hidden + dims.hidden)  # A of qkv, fc1; B of proj, fc2
    assert tp2 == whole + (dense - whole) // 2
    pp2 = [sum(adapter_split(dims, dataclasses.replace(lay, pp=2), s)) for s in (0, 1)]
    assert pp2 == [dense // 2, dense // 2]


def test_moe_experts_adapters_split_over_ep():
    dims, r = _dims("qwen3_moe"), 4
    lay = Layout(tp=1, pp=1, dp=2, lora_rank=r, lora_targets=tuple(TARGETS))
    _, e1 = adapter_split(dims, lay, 0)
    _, e2 = adapter_split(dims, dataclasses.replace(lay, ep=2), 0)
    moe_layers = len(dims.moe_layers)
    assert e1 == moe_layers * dims.experts * r * (dims.hidden + 2 * dims.expert_ffn + dims.expert_ffn + dims.hidden)
    assert e2 * 2 == e1


def test_lora_keeps_the_base_and_trains_the_adapters_alone():
    dims = _dims("qwen2")
    full = Layout(tp=2, pp=1, dp=2, reference=True, param_bytes=2)
    lora = dataclasses.replace(full, reference=False, lora_rank=8, lora_targets=tuple(TARGETS))
    f, lo = actor_static(dims, full, 0), actor_static(dims, lora, 0)
    adapters = sum(adapter_split(dims, lora, 0))
    assert lo["actor_weights"] == f["actor_weights"] and lo["adapters"] == adapters * 2
    assert lo["actor_grads"] == adapters * 4 and lo["reference"] == 0 < f["reference"]
    assert lo["optimizer"] == math.ceil(adapters / 2) * 12  # Adam m, v and fp32 main params, over DP = 2


def test_the_32b_recipe_needs_one_node_with_lora():
    from megatron_rlvr.plan.command import load_plan_inputs, make_plan

    overrides = ["actor.lora.rank=32", "actor.lora.alpha=32", 'model.use_transformer_engine="off"']
    cfg, hf, _ = load_plan_inputs("qwen2.5-32b_math-l3to5_casp", overrides, 1, 8)
    assert make_plan(cfg, hf, 1).fits
    cfg, hf, _ = load_plan_inputs("qwen2.5-32b_math-l3to5_casp", [], 1, 8)
    assert not make_plan(cfg, hf, 1).fits
