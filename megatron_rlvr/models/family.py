"""What a model family file provides (the `ModelFamily` protocol), and the checks every family shares (rope,
activation, norms, head sizes).

A family file (``qwen2.py``, ``llama.py``) is a module that satisfies `ModelFamily`; ``hf_config.family_of`` picks
one by the HF config's ``architectures`` field. Every family answers the mixture-of-experts questions
(``moe_shape``): a dense family with `DENSE`, so no caller asks "is this a MoE model?" of the HF config itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rlvr.errors import UserError


class UnsupportedModelError(UserError, ValueError):
    """The HF config names an architecture or a setting this project cannot reproduce exactly."""


@dataclass(frozen=True)
class MoeShape:
    """A model's routed experts: how many per MoE layer, how many each token uses, one expert's SwiGLU width, and
    which layers have them (``pattern[i]``: 1 MoE, 0 dense). `DENSE` for a model without experts."""

    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    pattern: tuple[int, ...] = ()


DENSE = MoeShape()


class ModelFamily(Protocol):
    """One HF architecture: its name, whether q/k/v carry a bias and a norm, its experts, its refusals and its
    megatron-core settings."""

    ARCHITECTURE: str
    QKV_BIAS: bool
    QK_NORM: bool  # a per-head RMSNorm on q and k before rope (megatron's qk_layernorm)

    def validate(self, hf: Mapping[str, Any], where: str) -> None:
        """Raise `UnsupportedModelError` naming ``where`` and the field for anything that would change the math."""

    def megatron_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The ``TransformerConfig`` fields this family sets beyond the shared ones."""

    def moe_shape(self, hf: Mapping[str, Any]) -> MoeShape:
        """The routed experts of a config this family validated; `DENSE` for a dense family."""


def head_dim(hf: Mapping[str, Any]) -> int:
    explicit = hf.get("head_dim")
    return int(explicit) if explicit else hf["hidden_size"] // hf["num_attention_heads"]


def num_kv_heads(hf: Mapping[str, Any]) -> int:
    return int(hf.get("num_key_value_heads") or hf["num_attention_heads"])


def rope_settings(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...scaling fields}`` from either transformers-5 ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling`` pair (what released Qwen2.5/Llama-3 checkpoints carry)."""
    params = hf.get("rope_parameters")
    if params:
        out = dict(params)
    else:
        out = dict(hf.get("rope_scaling") or {})
        if "rope_theta" in hf:
            out["rope_theta"] = hf["rope_theta"]
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    out.setdefault("rope_theta", 10000.0)
    return out


# megatron-core 0.16.1 applies llama3 scaling with these fixed constants (RotaryEmbedding._apply_scaling); only the
# factor is a parameter. A checkpoint whose other values differ would silently get different positions.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def validate_common(hf: Mapping[str, Any], where: str, allowed_rope_types: tuple[str, ...]) -> None:
    """Checks every supported family shares: required shapes, SwiGLU, divisibility of heads, rope type."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise UnsupportedModelError(f"HF config {where}: {key} must be a positive int, got {hf.get(key)!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"HF config {where}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU)")
    if hf["num_attention_heads"] % num_kv_heads(hf) != 0:
        raise UnsupportedModelError(
            f"HF config {where}: num_attention_heads={hf['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={num_kv_heads(hf)}"
        )
    rope = rope_settings(hf)
    if rope["rope_type"] not in allowed_rope_types:
        raise UnsupportedModelError(
            f"HF config {where}: rope_type={rope['rope_type']!r} is not supported for {hf['architectures'][0]}; "
            f"supported: {list(allowed_rope_types)}"
        )
    if rope["rope_type"] == "llama3":
        for key, expected in MEGATRON_LLAMA3_FIXED.items():
            got = rope.get(key)
            if got is None or not math.isclose(float(got), expected):
                raise UnsupportedModelError(
                    f"HF config {where}: llama3 rope {key}={got!r}, but megatron-core applies llama3 scaling with "
                    f"{key}={expected} fixed; this checkpoint's positions would differ"
                )
        if not rope.get("factor"):
            raise UnsupportedModelError(f"HF config {where}: llama3 rope scaling without a 'factor'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"HF config {where}: partial_rotary_factor != 1 is not supported")
