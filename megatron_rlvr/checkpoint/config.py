"""Configuration of checkpointing: how often, how many to keep, and what to resume from."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.settings import setting


@dataclass
class CheckpointConfig:
    """How often checkpoints are written, how many are kept, and what a run resumes from (docs/checkpoints.md)."""

    save_every: int = setting(
        0, "Write a checkpoint every N steps (0 = never; a preemption signal writes one too).", ge=0
    )
    keep_last: int = setting(2, "Checkpoints kept (0 = all); older ones are removed after a new one is complete.", ge=0)
    resume: str | None = setting("latest", "latest, a step directory, or null for a fresh start.")
