"""Configuration of the rollout engines and of sampling; each field declares its doc and limits
(megatron_rlvr/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rlvr.settings import setting

SyncStaging = Literal["full", "streaming"]
Placement = Literal["colocated", "separate"]


def _cut_range(cut: list[float]) -> bool:
    return len(cut) == 2 and 0 <= cut[0] <= cut[1] <= 1


@dataclass
class RolloutConfig:
    """The rollout engines (vLLM, colocated or on ranks of their own) and how they sample."""

    engine: Literal["vllm"] = setting("vllm", "The rollout engine.")
    group_size: int = setting(8, "Responses per prompt (G).", ge=1)
    temperature: float = setting(1.0, "Sampling temperature (training samples; every statistic is taken at it).", gt=0)
    top_p: float = setting(1.0, "Nucleus sampling's probability mass.", gt=0, le=1)
    max_new_tokens: int = setting(64, "The response's token budget (L_max).", ge=1)
    min_new_tokens: int = setting(
        0,
        "No EOS or stop string before this many tokens (benchmarks: a fixed generation length; at most "
        "max_new_tokens).",
        ge=0,
    )
    stop: list[str] = setting(factory=list, doc="Stop strings (kept at the end of the response).")
    tp: int = setting(1, "Engine tensor-parallel size (GPU; a CPU engine is always TP=1).", ge=1)
    max_model_len: int = setting(2048, "Prompt + response tokens the engine accepts per sequence.", ge=1)
    gpu_memory_utilization: float = setting(
        0.5, "The engine's share of a GPU when colocated with the actor.", gt=0, lt=1
    )
    sleep_level: Literal[1, 2] = setting(1, "vLLM sleep level between rollout and training (2 also drops the weights).")
    enforce_eager: bool = setting(False, "GPU only: skip CUDA graphs (CPU engines always run eagerly).")
    kv_cache_memory_bytes: int = setting(256 * 1024**2, "CPU engines: a bounded KV cache, in bytes.", ge=1)
    kv_block_size: int = setting(
        0,
        "Tokens per KV block, the prefix cache's unit (only whole blocks are shared); 0: vLLM's default (16 on a "
        "GPU, 128 on a CPU).",
        ge=0,
    )
    bucket_bytes: int = setting(256 * 1024**2, "Weight-sync bucket size, in bytes.", ge=1)
    sync_staging: SyncStaging = setting(
        "full",
        "full: the whole weight stream is received and validated before the engine is touched (a bad stream leaves "
        "the engine as it was; each engine rank holds its engine-TP shard meanwhile, docs/weight-sync.md). "
        "streaming: each tensor is checked as it arrives and loaded at once (no extra copy); a bad tensor "
        "mid-stream leaves a half-updated engine, reported as dead.",
    )
    check_sync: bool = setting(False, "Compare the engine's weights with the given ones after each sync (slow).")
    return_routed_experts: bool = setting(
        False,
        "MoE engines: return each sampled sequence's routed experts (Completion.routed_experts), what "
        "actor.router_replay=rollout replays; vLLM on GPU only (rollout/routed_experts.py).",
    )
    refill_max_rounds: int = setting(
        3, "algo.drop_uniform_groups: extra generation rounds per step to replace the uniform groups.", ge=0
    )
    placement: Placement = setting(
        "colocated",
        "colocated: every rank trains and serves an engine, taking turns; separate: the last engine_ranks ranks of "
        "the torchrun world serve engines only, the others are the actor (docs/separate-placement.md).",
    )
    engine_ranks: int = setting(0, "separate: the ranks serving engines (>= 1; 0 with colocated).", ge=0)
    max_staleness: int = setting(
        0,
        "Weight updates a response may lag (separate placement, docs/async.md): a response whose oldest token came "
        "from the weights of version v trains at a step <= v + max_staleness. 0: on-policy; 1: one-step-off (the "
        "engines sample step t+1 while the actor runs update t); >= 2: fully asynchronous (the engines stream: they "
        "admit a prompt only when it can train within the bound, take new weights between engine steps, and "
        "responses in flight continue with them).",
        ge=0,
    )
    recompute_kv_after_sync: bool = setting(
        False,
        "max_staleness >= 2: after a weight update in flight, recompute the KV cache of the responses in flight "
        "(and drop the prefix cache) with the new weights, so each token's engine log-prob is exactly its "
        "version's; false keeps the KV computed with the older weights (cheaper; the log-prob is still the one the "
        "token was sampled with).",
    )
    prefix_model: str | None = setting(
        None,
        "Outer prefixes: a prefix_fraction share of each group continues a weaker model's answer (an HF directory "
        "with the same tokenizer), cut at a uniform fraction in prefix_cut of its tokens; the prefix is context, not "
        "trained.",
    )
    prefix_fraction: float = setting(
        0.25, "The share of each group that continues a weaker model's prefix.", ge=0, le=1
    )
    prefix_cut: list[float] = setting(
        factory=lambda: [0.2, 0.8],
        doc="The range [lo, hi] of the fraction of the weaker answer's tokens the prefix keeps.",
        check=_cut_range,
        expect="a range [lo, hi] with 0 <= lo <= hi <= 1",
    )
