"""Configuration of the rollout engines and of sampling.

Plain data; ``__post_init__`` only checks ranges so a bad recipe fails at load time with the key's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SyncStaging = Literal["full", "streaming"]


@dataclass
class RolloutConfig:
    engine: Literal["vllm"] = "vllm"
    group_size: int = 8  # responses per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    tp: int = 1  # engine tensor-parallel size (GPU; a CPU engine is always TP=1)
    max_model_len: int = 2048  # prompt + response tokens the engine accepts per sequence
    gpu_memory_utilization: float = 0.5  # the engine's share when colocated with the actor
    sleep_level: Literal[1, 2] = 1  # vLLM sleep level between rollout and training (2 also drops the weights)
    enforce_eager: bool = False  # GPU only: skip CUDA graphs (CPU engines always run eagerly)
    kv_cache_memory_bytes: int = 256 * 1024**2  # CPU engines: a bounded KV cache
    bucket_bytes: int = 256 * 1024**2  # weight-sync bucket size
    # "full": the whole weight stream is received and validated before the engine is touched (a bad stream leaves
    # the engine as it was; holds one model copy meanwhile). "streaming": each tensor is checked as it arrives and
    # loaded at once (no extra copy); a bad tensor mid-stream leaves a half-updated engine, reported as dead.
    sync_staging: SyncStaging = "full"
    check_sync: bool = False  # compare engine weights with the given ones after each sync (slow)
    # algo.drop_uniform_groups: extra generation rounds per step to replace the groups whose rewards were all equal
    refill_max_rounds: int = 3

    def __post_init__(self) -> None:
        for key in ("group_size", "max_new_tokens", "tp", "max_model_len", "kv_cache_memory_bytes", "bucket_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key}: expected >= 1, got {getattr(self, key)!r}")
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
        if self.sync_staging not in ("full", "streaming"):
            raise ValueError(f"rollout.sync_staging: expected 'full' or 'streaming', got {self.sync_staging!r}")
