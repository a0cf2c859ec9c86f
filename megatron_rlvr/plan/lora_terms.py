"""The plan's LoRA terms (``actor.lora``, docs/lora.md; the adapters' layout is models/lora.py's): the adapter
parameters one rank holds, the whole adapter an engine serves, and what the adapters add to a layer's saved tensors.

With LoRA the base weights stay on every rank (frozen, no grad, no optimizer state), the adapters are the only
trained parameters (DDP's fp32 grads and Adam's state hold them alone), and the KL reference costs nothing (the
base with the adapters off). On one rank, per adapted linear of width in x out:

- column-parallel (``linear_qkv``, ``linear_fc1``, an expert's fc1): A whole, r x in; B cut over TP (ETP), out/tp x r;
- row-parallel (``linear_proj``, ``linear_fc2``, an expert's fc2): A cut over TP (ETP), r x in/tp; B whole, out x r.

Saved for the backward, per adapted linear and token: the adapter's [tokens, r] intermediate (its input is the
base's, which the layer keeps already).
"""

from __future__ import annotations

from typing import Any

from megatron_rlvr.models.dims import ModelDims


def _linears(dims: ModelDims, targets: tuple[str, ...], moe_layer: bool) -> list[tuple[bool, int, int, str, int]]:
    """(column, in, out, target, HF modules it stands for) of one layer's adapted linears (an MoE layer's experts:
    one expert's)."""
    out = []
    if "linear_qkv" in targets:
        out.append((True, dims.hidden, dims.q_width + 2 * dims.kv_width, "linear_qkv", 3))  # q, k, v
    if "linear_proj" in targets:
        out.append((False, dims.q_width, dims.hidden, "linear_proj", 1))
    mlp_target = "experts" if moe_layer else None
    ffn = dims.expert_ffn if moe_layer else dims.ffn
    if (mlp_target or "linear_fc1") in targets:
        out.append((True, dims.hidden, 2 * ffn, mlp_target or "linear_fc1", 2))  # gate, up
    if (mlp_target or "linear_fc2") in targets:
        out.append((False, ffn, dims.hidden, mlp_target or "linear_fc2", 1))
    return out


def _rank_params(column: bool, w_in: int, w_out: int, rank: int, split: int) -> int:
    return rank * (w_in + w_out // split) if column else rank * (w_in // split + w_out)


def adapter_split(dims: ModelDims, lay: Any, stage: int) -> tuple[int, int]:
    """(dense, expert) adapter parameters of one rank of pipeline stage ``stage`` (lay.lora_rank = 0: none)."""
    r = lay.lora_rank
    if not r:
        return 0, 0
    moe_layers = dims.moe_layers_of(lay.pp, stage)
    dense_layers = dims.layers // lay.pp - moe_layers
    dense = expert = 0
    for count, moe in ((dense_layers, False), (moe_layers, True)):
        for column, w_in, w_out, target, _ in _linears(dims, lay.lora_targets, moe):
            if target == "experts":
                expert += count * (dims.experts // lay.ep) * _rank_params(column, w_in, w_out, r, lay.etp)
            else:
                dense += count * _rank_params(column, w_in, w_out, r, lay.tp)
    return dense, expert


def adapter_hf_params(dims: ModelDims, rank: int, targets: tuple[str, ...]) -> int:
    """The whole adapter in PEFT's layout (bridge/peft.py: one A per HF module, so a fused linear's A counts once
    per module it stands for): what an engine serving ``actor.lora.sync: adapters`` loads and stages."""
    total = 0
    for i in range(dims.layers):
        moe = dims.is_moe_layer(i)
        for _, w_in, w_out, target, modules in _linears(dims, targets, moe):
            per = rank * (modules * w_in + w_out)
            total += per * (dims.experts if target == "experts" else 1)
    return total


def adapter_saved_bytes(dims: ModelDims, lay: Any, moe: bool) -> int:
    """What one layer's adapters keep for the backward, for one micro-batch: the [tokens, r] intermediate of each
    adapted linear (an expert's for each of the top_k copies of a token it computes)."""
    r = lay.lora_rank
    if not r:
        return 0
    per_token = 0
    for _, _, _, target, _ in _linears(dims, lay.lora_targets, moe):
        per_token += r * (dims.experts_per_token if target == "experts" else 1)
    return lay.micro_tokens * per_token * lay.param_bytes


def largest_adapter_grad(dims: ModelDims, lay: Any) -> int:
    """Values of the largest adapter half's gradient on one rank (the backward's transient weight gradient)."""
    sizes = [
        _rank_params(column, w_in, w_out, lay.lora_rank, lay.etp if target == "experts" else lay.tp)
        for moe in {dims.is_moe_layer(i) for i in range(dims.layers)}
        for column, w_in, w_out, target, _ in _linears(dims, lay.lora_targets, moe)
    ]
    return max(sizes, default=0)
