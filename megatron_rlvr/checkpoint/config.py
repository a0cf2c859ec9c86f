"""Configuration of checkpointing: how often, how many to keep, and what to resume from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    save_every: int = 0  # 0 = never
    keep_last: int = 2
    resume: str | None = "latest"  # "latest", a step directory, or null for a fresh start
