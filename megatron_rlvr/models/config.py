"""Configuration of where the actor's model comes from and how its vocabulary is padded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    """Where the actor's weights come from: an HF directory (config.json + safetensors) or a dist checkpoint."""

    hf_dir: str = ""
    load: str | None = None  # megatron dist checkpoint; overrides hf_dir's weights when given
    make_vocab_size_divisible_by: int = 128
    # the actor's layer spec: "auto" = Transformer Engine when it is installed, "on" = TE or an error, "off" = the
    # local (pure torch) spec even where TE is installed (to compare the two, or to debug one)
    use_transformer_engine: Literal["auto", "on", "off"] = "auto"
    # the local spec's core attention (without TE): "auto" = torch's scaled_dot_product_attention on a GPU, megatron's
    # unfused math on the CPU and under context parallelism; "sdpa" or "unfused" picks one (models/builder.py)
    core_attention: Literal["auto", "sdpa", "unfused"] = "auto"
