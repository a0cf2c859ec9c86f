"""The plan's terms of a vLLM engine (plan/memory.py sums them into phases): one rank's share of an engine inside
its ``gpu_memory_utilization`` budget (weights, KV cache, workspace), the tokens that KV cache holds, and how many
sequences the engines keep in flight under separate placement and asynchronous training.

Pure arithmetic of (ModelDims, Layout). The workspace is an estimate (ENGINE_WORKSPACE_BYTES), which
`megatron-rlvr plan` marks as such.
"""

from __future__ import annotations

import math
from typing import Protocol

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.lora_terms import adapter_hf_params
from megatron_rlvr.plan.units import GB

# vLLM's profiled activation peak, sampler logits and CUDA graphs inside its gpu_memory_utilization budget; sleep
# mode does not free it. An estimate from vLLM's profile run at its default batch limits, not measured here.
ENGINE_WORKSPACE_BYTES = int(2.0 * GB)


class Layout(Protocol):
    """What these terms read of plan/memory.py's Layout (declared here: memory.py imports this module)."""

    gpu: bool
    gpu_memory_utilization: float
    param_bytes: int
    engine_tp: int
    engine_ranks: int
    lora_rank: int
    lora_targets: tuple[str, ...]
    lora_sync: str
    max_seq_len: int
    max_staleness: int
    step_sequences: int


def engine_components(dims: ModelDims, lay: Layout, gpu_memory: int) -> dict[str, int]:
    """One rank's share of a vLLM engine: weights (HF count / engine TP, bf16 when the actor computes in bf16), the
    KV cache (what the gpu_memory_utilization budget leaves), and the workspace. Zero on CPU (no GPU budget)."""
    if not lay.gpu:
        return {"engine_weights": 0, "kv_cache": 0, "engine_workspace": 0, "engine_budget": 0}
    budget = int(lay.gpu_memory_utilization * gpu_memory)
    weights = dims.hf_params() * lay.param_bytes // lay.engine_tp
    if lay.lora_sync == "adapters" and lay.lora_rank:  # vLLM's LoRA: the adapter beside the base it serves
        weights += adapter_hf_params(dims, lay.lora_rank, lay.lora_targets) * lay.param_bytes // lay.engine_tp
    kv = budget - weights - ENGINE_WORKSPACE_BYTES
    return {
        "engine_weights": weights,
        "kv_cache": kv,
        "engine_workspace": ENGINE_WORKSPACE_BYTES,
        "engine_budget": budget,
    }


def kv_tokens(dims: ModelDims, lay: Layout, kv_cache: int) -> int:
    """Tokens the KV cache holds (one rank holds kv_heads/engine_tp heads of every token)."""
    per_token = dims.kv_bytes_per_token(lay.param_bytes) // lay.engine_tp
    return max(0, kv_cache) // per_token


def in_flight_sequences(lay: Layout) -> int:
    """Sequences one engine replica may hold at once: a step's (on-policy), two steps' (one-step-off: the step sampled
    ahead while the last one trains), or (k + 1) steps' under fully asynchronous training (the admission bound,
    experience/admission.py), shared by the replicas."""
    steps = 1 if lay.max_staleness == 0 else (2 if lay.max_staleness == 1 else lay.max_staleness + 1)
    replicas = max(1, lay.engine_ranks // lay.engine_tp)
    return math.ceil(steps * lay.step_sequences / replicas)


def in_flight_kv_note(dims: ModelDims, lay: Layout, kv_cache: int) -> str:
    """The KV the sequences in flight would take at full length against the engine's KV cache. The cache is a fixed
    budget (gpu_memory_utilization), so k steps in flight cost no GPU memory beyond it: what does not fit waits in
    vLLM's queue (or is preempted and recomputed), which costs time, not memory."""
    sequences = in_flight_sequences(lay)
    need = sequences * lay.max_seq_len * dims.kv_bytes_per_token(lay.param_bytes) // lay.engine_tp
    runnable = kv_tokens(dims, lay, kv_cache) // max(1, lay.max_seq_len)
    share = "all of them" if runnable >= sequences else f"{runnable} of them at once; the others wait in vLLM's queue"
    return (
        f"in flight: rollout.max_staleness={lay.max_staleness} lets one engine replica hold up to {sequences} "
        f"sequences, {need / GB:.1f} GB of KV at rollout.max_model_len={lay.max_seq_len}; its KV cache "
        f"({kv_cache / GB:.1f} GB) holds {share}"
    )
