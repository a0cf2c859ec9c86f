"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): SwiGLU, RMSNorm, GQA, bias on q/k/v only, tied or untied embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rlvr.models.family import DENSE, MoeShape, UnsupportedModelError, validate_common

ARCHITECTURE = "Qwen2ForCausalLM"
QKV_BIAS = True
QK_NORM = False


def validate(hf: Mapping[str, Any], where: str) -> None:
    validate_common(hf, where, allowed_rope_types=("default",))
    # Qwen2 applies a sliding window to layers >= max_window_layers only when use_sliding_window is set;
    # megatron-core's local attention has no per-layer window, so refuse rather than compute full attention.
    sliding_layers = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding_layers:
        raise UnsupportedModelError(
            f"HF config {where}: sliding-window attention is in use (use_sliding_window="
            f"{hf.get('use_sliding_window')}, sliding_window={hf.get('sliding_window')}, non-full layers "
            f"{sliding_layers}); megatron-core would compute full attention instead"
        )


def megatron_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": True}


def moe_shape(hf: Mapping[str, Any]) -> MoeShape:
    return DENSE
