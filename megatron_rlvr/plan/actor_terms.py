"""The plan's terms of an actor rank (plan/memory.py sums them into phases): what one rank of a pipeline stage holds
through every phase (weights, main grads, optimizer state, the frozen reference and the distillation teacher) and
what it holds while a micro-batch runs (the activations each layer saves for backward, x the micro-batches in flight
under 1F1B; the fused op's logits shard and per-token records).

Pure arithmetic of (ModelDims, Layout), as memory.py's docstring states each term; an MoE layer's router and experts
and context parallelism's gathered K/V are plan/parallel_terms.py's, LoRA's adapters plan/lora_terms.py's.
"""

from __future__ import annotations

import math
from typing import Protocol

from megatron_rlvr.models.builder import padded_vocab_size
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.lora_terms import adapter_saved_bytes, adapter_split
from megatron_rlvr.plan.parallel_terms import expert_shard_ranks, moe_mlp_saved_bytes
from megatron_rlvr.plan.stage_params import stage_params, stage_split, teacher_dims
from megatron_rlvr.plan.units import FP32


class Layout(Protocol):
    """What these terms read of plan/memory.py's Layout (declared here: memory.py imports this module)."""

    tp: int
    pp: int
    dp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    recompute: str
    micro_tokens: int
    max_seq_len: int
    micro_batches: int
    distributed_optimizer: bool
    param_bytes: int
    reference: bool
    teacher: str
    teacher_copy: bool
    teacher_top_n: int
    top_n: int
    divisible_by: int
    lora_rank: int
    lora_targets: tuple[str, ...]

    @property
    def attention_kind(self) -> str: ...


def teacher_bytes(dims: ModelDims, lay: Layout, stage: int) -> int:
    """The distillation teacher's weights on one rank of ``stage`` (0 without one)."""
    if lay.teacher:
        teacher = teacher_dims(lay.teacher)
        return stage_params(teacher, lay.tp, lay.pp, stage, lay.divisible_by, lay.ep, lay.etp) * lay.param_bytes
    if lay.teacher_copy:
        return stage_params(dims, lay.tp, lay.pp, stage, lay.divisible_by, lay.ep, lay.etp) * lay.param_bytes
    return 0


def actor_static(dims: ModelDims, lay: Layout, stage: int) -> dict[str, int]:
    """Weights, main grads, optimizer state and reference of one rank of ``stage``: held through every phase."""
    dense, expert = stage_split(dims, lay.tp, lay.pp, stage, lay.divisible_by, lay.ep, lay.etp)
    n = dense + expert
    per_value = 2 * FP32 + (FP32 if lay.param_bytes != FP32 else 0)  # Adam m, v (+ fp32 main params)
    if lay.lora_rank:  # the base frozen: grads and optimizer state of the adapters alone (plan/lora_terms.py)
        base_weights = n * lay.param_bytes
        dense, expert = adapter_split(dims, lay, stage)
        n = dense + expert
    if lay.distributed_optimizer:  # dense state over DP x CP, expert state over the expert-data-parallel ranks
        shard = math.ceil(dense / (lay.dp * lay.cp)) + math.ceil(expert / expert_shard_ranks(lay))
    else:
        shard = n
    return {
        "actor_weights": base_weights if lay.lora_rank else n * lay.param_bytes,
        "adapters": n * lay.param_bytes if lay.lora_rank else 0,
        "actor_grads": n * FP32,
        "optimizer": shard * per_value,
        "reference": n * lay.param_bytes if lay.reference else 0,
        "teacher": teacher_bytes(dims, lay, stage),
    }


def layer_activation_bytes(dims: ModelDims, lay: Layout, recompute: str | None = None, moe: bool = False) -> int:
    """What one transformer layer keeps for its backward, for one micro-batch of ``lay.micro_tokens`` tokens (per
    CP rank).

    Per token, in the compute dtype: the inputs of both norms and of the two linears they feed (sharded over TP
    with sequence parallelism), q, k, v after RoPE and the attention output (TP-sharded), and SwiGLU's fc1 output,
    silu(gate) and their product (TP-sharded); an MoE layer (``moe``) keeps its router's and experts' tensors
    instead of the dense MLP's (plan/parallel_terms.py). Unfused attention (CPU) also keeps the softmax output,
    [heads/tp, local queries, keys of the whole sequence] in fp32 (plus its cast when the compute dtype is not
    fp32), unless selective recompute drops it. Full recompute keeps only the layer's input.
    """
    recompute = lay.recompute if recompute is None else recompute
    t, e = lay.micro_tokens, lay.param_bytes
    h_part = dims.hidden // (lay.tp if lay.sequence_parallel else 1)
    if recompute == "full":
        return t * h_part * e
    mlp = 0 if moe else 4 * dims.ffn
    per_token = 4 * h_part + (2 * dims.q_width + 2 * dims.kv_width + mlp) // lay.tp
    stored = t * per_token * e + 2 * t * FP32  # + the norms' fp32 inverse RMS
    stored += adapter_saved_bytes(dims, lay, moe)
    if moe:
        stored += moe_mlp_saved_bytes(dims, lay)
    if recompute == "none" and lay.attention_kind == "unfused":
        s = min(lay.max_seq_len, t * lay.cp)  # keys: the whole sequence, gathered over CP
        score_values = dims.heads // lay.tp * s * t  # local queries t, each against its sequence's s keys
        stored += score_values * (FP32 + (e if e != FP32 else 0))
    return stored


def largest_layer_bytes(dims: ModelDims, lay: Layout, recompute: str | None = None) -> int:
    """One layer's saved tensors, of the larger kind (dense or MoE) the model has."""
    kinds = {dims.is_moe_layer(i) for i in range(dims.layers)}
    return max(layer_activation_bytes(dims, lay, recompute, moe=kind) for kind in kinds)


def in_flight(lay: Layout, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once under 1F1B: pp - stage (interleaving adds
    (pp - 1) / (pp * vpp) of a micro-batch per stage, Narayanan et al. 2021), at most the micro-batch count."""
    count = float(min(lay.pp - stage, lay.micro_batches))
    if lay.vpp and lay.pp > 1:
        count *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return count


def logits_bytes(dims: ModelDims, lay: Layout) -> int:
    """The output layer's logits shard [tokens, Vp/tp] in the compute dtype: the fused op keeps it for its backward
    and writes the gradient into it in place."""
    return lay.micro_tokens * padded_vocab_size(dims.vocab, lay.tp, lay.divisible_by) // lay.tp * lay.param_bytes


def op_scratch_bytes(lay: Layout) -> int:
    """The fused op's per-token fp64 records (4 + 2N values): this rank's and the TP all-gather of everyone's."""
    top_n = max(lay.top_n, lay.teacher_top_n)  # the teacher's pass runs the op with its own top-N
    return (lay.micro_tokens + 1) * (4 + 2 * top_n) * 8 * (1 + lay.tp)


def activations(dims: ModelDims, lay: Layout, stage: int) -> int:
    """Stored activations of a stage during the update: its layers x the micro-batches in flight, plus on the last
    stage the final norm's input and output (the output layer's input)."""
    moe_layers = dims.moe_layers_of(lay.pp, stage)
    dense_layers = dims.layers // lay.pp - moe_layers
    dense = dense_layers * layer_activation_bytes(dims, lay)
    moe = moe_layers * layer_activation_bytes(dims, lay, moe=True)
    total = in_flight(lay, stage) * (dense + moe)
    if stage == lay.pp - 1:
        h_part = dims.hidden // (lay.tp if lay.sequence_parallel else 1)
        total += 2 * lay.micro_tokens * h_part * lay.param_bytes
    return int(total)
