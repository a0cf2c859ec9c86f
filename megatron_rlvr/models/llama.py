"""Llama 2/3.x (``LlamaForCausalLM``): SwiGLU, RMSNorm, GQA, no linear biases, llama3 rope scaling, tied
embeddings in 3.2-1B/3B."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rlvr.models.family import DENSE, MoeShape, UnsupportedModelError, validate_common

ARCHITECTURE = "LlamaForCausalLM"
QKV_BIAS = False
QK_NORM = False


def validate(hf: Mapping[str, Any], where: str) -> None:
    validate_common(hf, where, allowed_rope_types=("default", "llama3"))
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UnsupportedModelError(f"HF config {where}: {key}=true is not supported (Llama has no biases)")
    if hf.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError(
            f"HF config {where}: pretraining_tp={hf['pretraining_tp']} changes the math; need 1"
        )


def megatron_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": False}


def moe_shape(hf: Mapping[str, Any]) -> MoeShape:
    return DENSE
