"""LoRA through the bridge, on 2 gloo ranks (tiny Qwen2, fp32): the merged export at TP = 2 (lent and fresh) and at
PP = 2 equals W + (alpha / r) B A computed here in float64 from the HF base file and the HF-layout adapters the test
drew, bit for bit after rounding to fp32; the adapter export gives exactly those adapters in PEFT's names
(``base_model.model.<HF module>.lora_A.weight``, as PEFT's checkpoint format documents); `save_adapter` writes the
PEFT directory, which names its base by an absolute path, so that ``peft.AutoPeftModelForCausalLM`` loads it from any
directory; its ``merge_and_unload()`` equals the merged export (where peft is installed: requirements-cpu.txt has it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rlvr.testing.rounding import UNIT_ROUNDOFF_FP32, fp32_sum_bound
from tests.integration.actor.lora_workers import _draw, adapters_hf, build, fill_from_hf_layout

pytestmark = pytest.mark.dist

RANK, ALPHA = 4, 8.0
LAYERS, MODULES = 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_bridge"), seed=8))


def _exports(hf_dir: str, tp: int, pp: int, lend: bool, adapter_dir: str | None):
    from megatron_rlvr.checkpoint import save_adapter
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=11):
        actor = build(hf_dir, tp=tp, pp=pp, rank=RANK)
        fill_from_hf_layout(actor, seed=9)
        merged = {n: t.clone() for bucket in actor.export_weights(1 << 20, lend=lend) for n, t in bucket}
        adapters = adapters_hf(actor)
        config = actor.adapter_config()
        if adapter_dir:
            save_adapter(actor, adapter_dir)
        return merged, adapters, config


def _expected(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(merged HF weights, PEFT-named adapters) from the base file and the test's own draws, in float64."""
    from safetensors.torch import load_file

    from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.models.hf_config import read_hf_config

    base = load_file(str(Path(hf_dir) / "model.safetensors"))
    dims = ModelDims.from_hf(read_hf_config(hf_dir))
    merged, adapters = dict(base), {}
    for m in mapping_table(dims):
        stem = m.megatron.removesuffix(".weight")
        if not stem.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) or m.megatron == stem:
            continue
        shapes = hf_shapes(m, dims)
        a = _draw(f"{stem}.A", (RANK, shapes[0][1]), 9)
        for h, s in zip(m.hf, shapes):
            b = _draw(f"{h}.B", (s[0], RANK), 9)
            merged[h] = (base[h].double() + ALPHA / RANK * (b.double() @ a.double())).float()
            adapters[f"base_model.model.{h[: -len('.weight')]}.lora_A.weight"] = a
            adapters[f"base_model.model.{h[: -len('.weight')]}.lora_B.weight"] = b
    return merged, adapters


@pytest.mark.parametrize("tp,pp,lend", [(2, 1, True), (2, 1, False), (1, 2, False)])
def test_merged_export_is_w_plus_scaled_ba_bit_for_bit(workers2, tiny_qwen, tp, pp, lend, tmp_path):
    adapter_dir = str(tmp_path / "adapter")
    (merged, adapters, config), _ = workers2.run(_exports, tiny_qwen, tp, pp, lend, adapter_dir)
    want_merged, want_adapters = _expected(tiny_qwen)
    assert sorted(merged) == sorted(want_merged)
    differing = [n for n in want_merged if not torch.equal(merged[n], want_merged[n])]
    assert not differing, differing[:5]
    changed = sum(not torch.equal(merged[n], t) for n, t in _expected_base(tiny_qwen).items())
    assert changed == LAYERS * len(MODULES)  # every adapted linear, nothing else
    # the adapter alone, in PEFT's names and layout
    assert sorted(adapters) == sorted(want_adapters) and len(adapters) == LAYERS * len(MODULES) * 2
    assert all(torch.equal(adapters[n], want_adapters[n]) for n in adapters)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapters
    # save_adapter: the PEFT directory (adapter_config.json + adapter_model.safetensors)
    from megatron_rlvr.bridge.peft import read_adapter

    tensors, saved = read_adapter(adapter_dir)
    assert saved == config == json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == RANK and saved["lora_alpha"] == ALPHA
    assert saved["target_modules"] == sorted(MODULES) and not saved["use_rslora"]
    assert sorted(tensors) == sorted(adapters) and all(torch.equal(tensors[n], adapters[n]) for n in tensors)


def _expected_base(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors"))


def _exports_from_a_relative_base(hf_dir: str, tp: int, pp: int, adapter_dir: str):
    """`_exports` with ``model.hf_dir`` given relative to the workers' directory, as a recipe gives it."""
    import os

    return _exports(os.path.relpath(hf_dir), tp, pp, False, adapter_dir)


def test_peft_loads_the_adapter_from_another_directory_and_merges_it_into_the_merged_export(
    workers2, tiny_qwen, tmp_path, monkeypatch
):
    """The adapter names its base by an absolute path, so PEFT's own loader finds the base from any directory,
    and its merge_and_unload() equals the merged export."""
    peft = pytest.importorskip("peft")  # tools/env/requirements-cpu.txt installs it

    adapter_dir = tmp_path / "adapter"
    (merged, _, config), _ = workers2.run(_exports_from_a_relative_base, tiny_qwen, 2, 1, str(adapter_dir))
    assert config["base_model_name_or_path"] == str(Path(tiny_qwen).resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32)
    model = loaded.merge_and_unload()
    state = model.state_dict()
    worst = max((state[n].double() - merged[n].double()).abs().max().item() for n in merged if n in state)
    # PEFT merges W + (alpha / r) B A in fp32 (a reduction of r products, then the sum with W: rank + 1 terms of up to
    # max|W| and alpha max|B| max|A| each); the export is that float64 sum rounded once to fp32 (half an ulp)
    _, adapters = _expected(tiny_qwen)
    base = _expected_base(tiny_qwen)
    a_max = max(t.abs().max().item() for n, t in adapters.items() if "lora_A" in n)
    b_max = max(t.abs().max().item() for n, t in adapters.items() if "lora_B" in n)
    magnitude = max(t.abs().max().item() for t in base.values()) + ALPHA * a_max * b_max
    top = max(t.abs().max().item() for t in merged.values())
    bound = fp32_sum_bound(RANK + 1, magnitude, implementations=1) + UNIT_ROUNDOFF_FP32 * top
    print(
        f"peft merge_and_unload vs the merged export, TP=2: max |delta| {worst:.1e} over {len(merged)} tensors; "
        f"fp32 bound {bound:.1e}"
    )
    assert worst <= bound
