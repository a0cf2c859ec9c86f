"""Configuration of the verifier pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    workers: int = 2
    timeout_s: float = 10.0  # wall time per item
    code_memory_mb: int = 1024
    code_cpu_s: float = 5.0
