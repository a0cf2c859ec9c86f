"""Reading an HF ``config.json`` and the checks shared by every supported family (rope, activation, norms).

The family files (``qwen2.py``, ``llama.py``) hold what differs; this module picks one by the ``architectures``
field and refuses anything that would silently change the math.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from megatron_rlvr.errors import UserError


class UnsupportedModelError(UserError, ValueError):
    """The HF config names an architecture or a setting this project cannot reproduce exactly."""


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Read ``config.json`` (a directory, the file itself, or an already-loaded dict) and validate it.

    Returns a plain dict; raises :class:`UnsupportedModelError` naming the file and field for anything unsupported.
    """
    if isinstance(source, Mapping):
        hf, where = dict(source), "<config dict>"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"HF config {path}: not found (expected an HF model directory or its config.json)")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"HF config {path}: not valid JSON: {e}") from e
        where = str(path)
    family_of(hf, where).validate(hf, where)
    return hf


def family_of(hf: Mapping[str, Any], where: str = "<config dict>"):
    """The family module (``qwen2`` or ``llama``) for this config's ``architectures`` entry."""
    from megatron_rlvr.models import llama, qwen2

    families = {qwen2.ARCHITECTURE: qwen2, llama.ARCHITECTURE: llama}
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in families:
        raise UnsupportedModelError(
            f"HF config {where}: architectures={archs!r} is not supported; supported: {sorted(families)}"
        )
    return families[archs[0]]


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
