"""Configuration of the rollout engines and of sampling.

Plain data; ``__post_init__`` only checks ranges so a bad recipe fails at load time with the key's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SyncStaging = Literal["full", "streaming"]
Placement = Literal["colocated", "separate"]


@dataclass
class RolloutConfig:
    engine: Literal["vllm"] = "vllm"
    group_size: int = 8  # responses per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    min_new_tokens: int = 0  # no EOS or stop string before this many tokens (benchmarks: a fixed generation length)
    stop: list[str] = field(default_factory=list)
    tp: int = 1  # engine tensor-parallel size (GPU; a CPU engine is always TP=1)
    max_model_len: int = 2048  # prompt + response tokens the engine accepts per sequence
    gpu_memory_utilization: float = 0.5  # the engine's share when colocated with the actor
    sleep_level: Literal[1, 2] = 1  # vLLM sleep level between rollout and training (2 also drops the weights)
    enforce_eager: bool = False  # GPU only: skip CUDA graphs (CPU engines always run eagerly)
    kv_cache_memory_bytes: int = 256 * 1024**2  # CPU engines: a bounded KV cache
    # tokens per KV block, the prefix cache's unit (only whole blocks are shared); 0: vLLM's default (16 on a GPU,
    # 128 on a CPU)
    kv_block_size: int = 0
    bucket_bytes: int = 256 * 1024**2  # weight-sync bucket size
    # "full": the whole weight stream is received and validated before the engine is touched (a bad stream leaves
    # the engine as it was; each engine rank holds its engine-TP shard meanwhile, docs/weight-sync.md). "streaming":
    # each tensor is checked as it arrives and loaded at once (no extra copy); a bad tensor mid-stream leaves a
    # half-updated engine, reported as dead.
    sync_staging: SyncStaging = "full"
    check_sync: bool = False  # compare engine weights with the given ones after each sync (slow)
    # MoE engines: return each sampled sequence's routed experts (Completion.routed_experts), what
    # actor.router_replay=rollout replays; vLLM on GPU only (rollout/routed_experts.py)
    return_routed_experts: bool = False
    # algo.drop_uniform_groups: extra generation rounds per step to replace the groups whose rewards were all equal
    refill_max_rounds: int = 3
    # "colocated": every rank trains and serves an engine, taking turns. "separate": the last engine_ranks ranks of
    # the torchrun world serve engines only, the others are the actor (docs/separate-placement.md)
    placement: Placement = "colocated"
    engine_ranks: int = 0
    # weight updates a response may lag (separate placement, docs/async.md): a response whose oldest token came from
    # the weights of version v trains at a step <= v + max_staleness. 0: on-policy; 1: one-step-off (the engines
    # sample step t+1 while the actor runs update t); >= 2: fully asynchronous (the engines stream: they admit a
    # prompt only when it can train within the bound, take new weights between engine steps, and responses in flight
    # continue with them)
    max_staleness: int = 0
    # max_staleness >= 2: after a weight update in flight, recompute the KV cache of the responses in flight (and
    # drop the prefix cache) with the new weights, so each token's engine log-prob is exactly its version's; false
    # keeps the KV computed with the older weights (cheaper; the log-prob is still the one the token was sampled with)
    recompute_kv_after_sync: bool = False
    # outer prefixes: a prefix_fraction share of each group continues a weaker model's answer (an HF directory with
    # the same tokenizer), cut at a uniform fraction in prefix_cut of its tokens; the prefix is context, not trained
    prefix_model: str | None = None
    prefix_fraction: float = 0.25
    prefix_cut: list[float] = field(default_factory=lambda: [0.2, 0.8])

    def __post_init__(self) -> None:
        for key in ("group_size", "max_new_tokens", "tp", "max_model_len", "kv_cache_memory_bytes", "bucket_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key}: expected >= 1, got {getattr(self, key)!r}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"rollout.min_new_tokens: expected 0 .. rollout.max_new_tokens={self.max_new_tokens}, "
                f"got {self.min_new_tokens!r}"
            )
        if self.kv_block_size < 0:
            raise ValueError(f"rollout.kv_block_size: expected >= 0 (0: vLLM's default), got {self.kv_block_size!r}")
        if self.refill_max_rounds < 0:
            raise ValueError(f"rollout.refill_max_rounds: expected >= 0, got {self.refill_max_rounds!r}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature: expected > 0 (training samples), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p: expected in (0, 1], got {self.top_p!r}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"rollout.gpu_memory_utilization: expected in (0, 1), got {self.gpu_memory_utilization!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level: expected 1 or 2, got {self.sleep_level!r}")
        if self.placement not in ("colocated", "separate"):
            raise ValueError(f"rollout.placement: expected 'colocated' or 'separate', got {self.placement!r}")
        if self.engine_ranks < 0 or (self.placement == "separate") != (self.engine_ranks > 0):
            raise ValueError(
                f"rollout.engine_ranks: expected >= 1 with placement 'separate' and 0 with 'colocated', "
                f"got {self.engine_ranks!r} with {self.placement!r}"
            )
        if not 0 <= self.prefix_fraction <= 1:
            raise ValueError(f"rollout.prefix_fraction: expected a share in [0, 1], got {self.prefix_fraction!r}")
        if len(self.prefix_cut) != 2 or not 0 <= self.prefix_cut[0] <= self.prefix_cut[1] <= 1:
            raise ValueError(
                f"rollout.prefix_cut: expected a range [lo, hi] with 0 <= lo <= hi <= 1, got {list(self.prefix_cut)!r}"
            )
        if self.max_staleness < 0:
            raise ValueError(
                f"rollout.max_staleness: expected >= 0 (0: on-policy, 1: one-step-off, k >= 2: fully asynchronous), "
                f"got {self.max_staleness!r}"
            )
        if self.sync_staging not in ("full", "streaming"):
            raise ValueError(f"rollout.sync_staging: expected 'full' or 'streaming', got {self.sync_staging!r}")
