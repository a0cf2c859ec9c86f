"""Rollout engines behind one protocol (`RolloutEngine`): vLLM on GPU (colocated, sleep mode) and on CPU (in-process),
optionally wrapped so that part of each group continues a weaker model's prefix (`prefixes.PrefixedEngine`).

Importing this package does not import vLLM; `make_engine` does, on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.rollout.base import (
    Completion,
    EngineDiedError,
    Episode,
    PrefixCacheCounts,
    Progress,
    RolloutEngine,
    Sampling,
    StreamingEngine,
    prompt_seed,
)
from megatron_rlvr.rollout.config import RolloutConfig
from megatron_rlvr.rollout.weight_manifest import WeightManifest, WeightSyncError

if TYPE_CHECKING:
    from megatron_rlvr.models.lora import AdapterSpec
    from megatron_rlvr.rollout.prefixes import PrefixedEngine
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine


def make_engine(
    model_dir: str | Path,
    cfg: RolloutConfig,
    *,
    seed: int = 0,
    dtype: str = "float32",
    adapter: AdapterSpec | None = None,
    stop_token_ids: tuple[int, ...] = (),
) -> VLLMEngine | PrefixedEngine:
    """Build the engine ``cfg.engine`` names from an HF directory; sync the actor's weights into it afterwards.
    ``stop_token_ids``: tokens every completion also ends at, kept as its last token (a chat template's end of turn,
    `problems.prompt_encoding.end_of_turn_id`).
    With ``cfg.prefix_model`` set, a second (frozen) engine serves that weaker model and the returned wrapper mixes
    its prefixes into each group; the two must share the tokenizer (checked before either engine starts).
    ``adapter``: the target serves the actor's LoRA adapters on its base (``actor.lora.sync: adapters``)."""
    from megatron_rlvr.rollout.vllm_engine import make_engine as make_vllm_engine

    if not cfg.prefix_model:
        return make_vllm_engine(model_dir, cfg, seed=seed, dtype=dtype, adapter=adapter, stop_token_ids=stop_token_ids)
    from megatron_rlvr.rollout.prefixes import PrefixedEngine, check_prefix_model

    tokenizer = check_prefix_model(model_dir, cfg.prefix_model)
    target = make_vllm_engine(model_dir, cfg, seed=seed, dtype=dtype, adapter=adapter, stop_token_ids=stop_token_ids)
    try:
        weak = make_vllm_engine(cfg.prefix_model, cfg, seed=seed, dtype=dtype, stop_token_ids=stop_token_ids)
    except BaseException:
        target.close()
        raise
    return PrefixedEngine(
        target,
        weak,
        cfg.prefix_fraction,
        cfg.prefix_cut,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


__all__ = [
    "Completion",
    "EngineDiedError",
    "Episode",
    "PrefixCacheCounts",
    "Progress",
    "RolloutConfig",
    "RolloutEngine",
    "Sampling",
    "StreamingEngine",
    "WeightManifest",
    "WeightSyncError",
    "make_engine",
    "prompt_seed",
]
