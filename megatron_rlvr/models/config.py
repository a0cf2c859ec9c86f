"""Configuration of where the actor's model comes from and how its vocabulary is padded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rlvr.settings import setting


@dataclass
class ModelConfig:
    """Where the actor's weights come from: an HF directory (config.json + safetensors) or a dist checkpoint."""

    hf_dir: str = setting("", "The HF model directory (config.json, tokenizer and safetensors).")
    load: str | None = setting(None, "A megatron dist checkpoint; overrides hf_dir's weights when given.")
    make_vocab_size_divisible_by: int = setting(128, "The vocabulary is padded to a multiple of this (times TP).", ge=1)
    use_transformer_engine: Literal["auto", "on", "off"] = setting(
        "auto",
        "The actor's layer spec: auto = Transformer Engine when it is installed, on = TE or an error, off = the "
        "local (pure torch) spec even where TE is installed (to compare the two, or to debug one).",
    )
    core_attention: Literal["auto", "sdpa", "unfused"] = setting(
        "auto",
        "The local spec's core attention (without TE): auto = torch's scaled_dot_product_attention on a GPU, "
        "megatron's unfused math on the CPU and under context parallelism; sdpa or unfused picks one "
        "(models/builder.py).",
    )
    packed_attention_block_tokens: int = setting(
        256,
        "The unfused packed attention (runtime/cpu/attention.py) runs short sequences together, one dense call per "
        "block of at most this many tokens; a longer sequence is a block alone.",
        ge=1,
    )
