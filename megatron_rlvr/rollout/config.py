"""Configuration of the rollout engines and of sampling."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutConfig:
    engine: str = "vllm"
    group_size: int = 8  # responses per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    tp: int = 1  # engine tensor-parallel size
    gpu_memory_utilization: float = 0.5  # the engine's share when colocated with the actor
    kv_cache_memory_bytes: int = 256 * 1024**2  # CPU engines: a bounded KV cache
    bucket_bytes: int = 256 * 1024**2  # weight-sync bucket size
    check_sync: bool = False  # compare engine weights with the actor's after each sync (slow)
