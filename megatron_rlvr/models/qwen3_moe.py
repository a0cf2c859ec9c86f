"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms, no biases) and, on the layers its pattern
picks, a softmax top-k router over routed experts (SwiGLU each), no shared experts.

Routing as transformers computes it: ``p = softmax(logits)`` in fp32, the top-k of ``p``, renormalized over the
k when ``norm_topk_prob``. Megatron-core's router gives the same: pre-softmax top-k without renormalization, or
the softmax of the top-k logits (the same probabilities renormalized) with it; its logits and softmax run in fp32
(``moe_router_dtype``). Layer ``i`` is an MoE layer when ``i not in mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``, otherwise a dense MLP of ``intermediate_size`` (megatron's per-layer
``moe_layer_freq`` list).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rlvr.models.family import MoeShape, UnsupportedModelError, validate_common
from megatron_rlvr.models.qwen3 import validate_attention

ARCHITECTURE = "Qwen3MoeForCausalLM"
QKV_BIAS = False
QK_NORM = True

# Fields other MoE families carry that would change the routing or add experts this family file does not build;
# a config that sets one to anything but its neutral value is refused (DeepSeek-style routers and shared experts
# are a later family file).
_FOREIGN_ROUTING = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1.0),
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
}


def num_experts(hf: Mapping[str, Any]) -> int:
    """Released checkpoints spell it ``num_experts``; transformers 5 writes ``num_local_experts``."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def moe_layer_pattern(hf: Mapping[str, Any]) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer index (transformers' Qwen3MoeDecoderLayer rule)."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and num_experts(hf) > 0 and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]


def moe_shape(hf: Mapping[str, Any]) -> MoeShape:
    return MoeShape(
        experts=num_experts(hf),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_ffn=int(hf["moe_intermediate_size"]),
        pattern=tuple(moe_layer_pattern(hf)),
    )


def validate(hf: Mapping[str, Any], where: str) -> None:
    validate_common(hf, where, allowed_rope_types=("default",))
    validate_attention(hf, where)
    for key, neutral in _FOREIGN_ROUTING.items():
        if hf.get(key) not in neutral:
            raise UnsupportedModelError(
                f"HF config {where}: {key}={hf[key]!r} is not supported for {ARCHITECTURE} (a softmax top-k router "
                f"over routed experts only; expected {key} unset)"
            )
    experts, topk = num_experts(hf), hf.get("num_experts_per_tok")
    if experts < 1:
        raise UnsupportedModelError(f"HF config {where}: num_experts must be a positive int, got {experts}")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise UnsupportedModelError(f"HF config {where}: num_experts_per_tok={topk!r}; expected 1..{experts}")
    if not isinstance(hf.get("moe_intermediate_size"), int) or hf["moe_intermediate_size"] <= 0:
        raise UnsupportedModelError(
            f"HF config {where}: moe_intermediate_size must be a positive int, got {hf.get('moe_intermediate_size')!r}"
        )
    bad = [i for i in hf.get("mlp_only_layers") or [] if not 0 <= i < hf["num_hidden_layers"]]
    if bad:
        raise UnsupportedModelError(f"HF config {where}: mlp_only_layers has indices {bad} outside the layers")
    if not any(moe_layer_pattern(hf)):
        raise UnsupportedModelError(f"HF config {where}: decoder_sparse_step / mlp_only_layers leave no MoE layer")


def megatron_kwargs(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "num_moe_experts": num_experts(hf),
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_router_score_function": "softmax",
        # no renormalization = softmax over all experts, then top-k (transformers' order); with it, the softmax of
        # the k largest logits, which equals transformers' renormalized top-k probabilities
        "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
        "moe_router_dtype": "fp32",
        "moe_layer_freq": moe_layer_pattern(hf),
        # the actor sets a balancing loss when actor.moe_aux_loss_coeff > 0; the model's own math has none
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        # the all-to-all dispatcher: runs over gloo on CPU, and is what variable sequence lengths require
        "moe_token_dispatcher_type": "alltoall",
        # megatron-core's SequentialMLP (one MLP per local expert); TE grouped GEMM is not wired here yet
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }
