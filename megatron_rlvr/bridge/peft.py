"""PEFT's LoRA checkpoint format: the names, the config and the files an adapter directory holds (docs/lora.md).

- ``adapter_model.safetensors``: ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``...lora_B.weight``
  [out, r] per adapted HF linear (PEFT's save strips the adapter's own name from the keys).
- ``adapter_config.json``: ``peft_type: LORA``, ``r``, ``lora_alpha`` (the update is scaled by lora_alpha / r: no
  rsLoRA), ``lora_dropout``, ``target_modules`` (HF module names) and ``base_model_name_or_path``: the base's
  directory as an absolute path (a relative ``model.hf_dir`` would only resolve from the directory training ran in),
  or the name given where it is no local directory (a hub name).

One of our adapters on a fused Megatron linear is several of PEFT's, exactly: on ``linear_qkv`` (A [r, hidden], B
[q + k + v rows, r]) it is q_proj, k_proj and v_proj sharing A, each with its rows of B (``B_q A x`` is the q rows of
``B A x``); on ``linear_fc1`` it is gate_proj and up_proj sharing A. vLLM's LoRA loads these directories, and so
does ``peft.PeftModel.from_pretrained`` onto the HF base.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.bridge.mapping import mapping_table
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.lora import A_NAME, B_NAME, AdapterSpec, target_of

PREFIX = "base_model.model."
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def peft_name(hf_weight: str, half: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight``, ``lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight``."""
    if half not in (A_NAME, B_NAME) or not hf_weight.endswith(".weight"):
        raise ValueError(f"peft_name: {hf_weight!r}, {half!r}: expected an HF weight name and lora_A or lora_B")
    return f"{PREFIX}{hf_weight[: -len('.weight')]}.{half}.weight"


def module_of(name: str) -> str:
    """The HF module's last name (``q_proj``) of a PEFT tensor name: what ``target_modules`` lists."""
    return name.rsplit(".", 3)[-3]


def target_modules(dims: ModelDims, spec: AdapterSpec) -> list[str]:
    """The HF modules (``q_proj``, ...) that carry one of PEFT's adapters when ``spec``'s linears carry ours."""
    names = set()
    for m in mapping_table(dims):
        stem = m.megatron.removesuffix(".weight")
        if m.megatron.endswith(".weight") and target_of(stem) in spec.targets:
            names.update(module_of(peft_name(h, A_NAME)) for h in m.hf)
    return sorted(names)


def adapter_config(spec: AdapterSpec, target_modules: Iterable[str], base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` for adapters of ``spec`` on the HF modules named ``target_modules``; ``base_model``
    is read from this process's working directory when it is a local directory, and recorded as an absolute path."""
    base = Path(base_model)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.resolve()) if base.is_dir() else base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """Write an adapter directory (the two files; ``out_dir`` is created). Returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=1) + "\n")
    return out


def read_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config) of an adapter directory."""
    from safetensors.torch import load_file

    root = Path(adapter_dir)
    return load_file(str(root / WEIGHTS_FILE)), json.loads((root / CONFIG_FILE).read_text())
