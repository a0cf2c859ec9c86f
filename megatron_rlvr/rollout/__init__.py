"""Rollout engines behind one protocol (`RolloutEngine`): vLLM on GPU (colocated, sleep mode) and on CPU (in-process).

Importing this package does not import vLLM; `make_engine` does, on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.rollout.base import Completion, EngineDiedError, RolloutEngine, Sampling
from megatron_rlvr.rollout.config import RolloutConfig
from megatron_rlvr.rollout.weight_manifest import WeightManifest, WeightSyncError

if TYPE_CHECKING:
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine


def make_engine(model_dir: str | Path, cfg: RolloutConfig, *, seed: int = 0, dtype: str = "float32") -> "VLLMEngine":
    """Build the engine ``cfg.engine`` names from an HF directory; sync the actor's weights into it afterwards."""
    from megatron_rlvr.rollout.vllm_engine import make_engine as make_vllm_engine

    return make_vllm_engine(model_dir, cfg, seed=seed, dtype=dtype)


__all__ = [
    "Completion",
    "EngineDiedError",
    "RolloutConfig",
    "RolloutEngine",
    "Sampling",
    "WeightManifest",
    "WeightSyncError",
    "make_engine",
]
