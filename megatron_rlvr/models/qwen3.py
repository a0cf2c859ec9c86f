"""Qwen3 dense (``Qwen3ForCausalLM``): Qwen2's layout without q/k/v biases, plus a per-head RMSNorm on q and k
before rope (megatron's ``qk_layernorm``) and an explicit ``head_dim`` that may differ from hidden / heads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rlvr.models.family import DENSE, MoeShape, UnsupportedModelError, validate_common

ARCHITECTURE = "Qwen3ForCausalLM"
QKV_BIAS = False
QK_NORM = True


def validate_attention(hf: Mapping[str, Any], where: str) -> None:
    """The attention checks Qwen3 dense and Qwen3-MoE share: no biases, full attention on every layer."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"HF config {where}: attention_bias=true is not supported for Qwen3 (it has none)")
    # megatron-core's local attention has no per-layer window: refuse rather than compute full attention.
    sliding_layers = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding_layers:
        raise UnsupportedModelError(
            f"HF config {where}: sliding-window attention is in use (use_sliding_window="
            f"{hf.get('use_sliding_window')}, sliding_window={hf.get('sliding_window')}, non-full layers "
            f"{sliding_layers}); megatron-core would compute full attention instead"
        )


def validate(hf: Mapping[str, Any], where: str) -> None:
    validate_common(hf, where, allowed_rope_types=("default",))
    validate_attention(hf, where)


def megatron_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": False, "qk_layernorm": True}


def moe_shape(hf: Mapping[str, Any]) -> MoeShape:
    return DENSE
