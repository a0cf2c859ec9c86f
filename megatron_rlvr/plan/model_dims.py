"""The model's shapes as the plan reads them (`ModelDims`, from an HF config.json) and the exact parameter count of
one pipeline stage at a tensor-parallel size, as megatron-core builds it (padded vocabulary included)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_rlvr.errors import ConfigError

# megatron-core's DDP grad buffer starts every parameter at a multiple of 64 values with the distributed optimizer.
PARAM_ALIGN = 64


@dataclass(frozen=True)
class ModelDims:
    """The shapes of a Qwen2 / Llama model that decide its memory, from its HF config.json."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelDims:
        from megatron_rlvr.models.family import head_dim, num_kv_heads
        from megatron_rlvr.models.hf_config import family_of

        return cls(
            hidden=int(hf["hidden_size"]),
            ffn=int(hf["intermediate_size"]),
            layers=int(hf["num_hidden_layers"]),
            heads=int(hf["num_attention_heads"]),
            kv_heads=num_kv_heads(hf),
            head_dim=head_dim(hf),
            vocab=int(hf["vocab_size"]),
            tied=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(family_of(hf).QKV_BIAS),
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self, tp: int) -> int:
        """One transformer layer's parameters on one TP rank: QKV (+ bias), output projection, SwiGLU fc1/fc2,
        and the two RMSNorm weights, which every TP rank holds whole."""
        qkv = self.q_width + 2 * self.kv_width
        sharded = self.hidden * qkv + (qkv if self.qkv_bias else 0) + self.q_width * self.hidden
        sharded += 3 * self.hidden * self.ffn
        return sharded // tp + 2 * self.hidden

    def hf_params(self) -> int:
        """The checkpoint's parameter count (unpadded vocabulary): what an engine holds in total."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params(1) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers (the engine's KV cache, before its TP split)."""
        return 2 * self.layers * self.kv_width * dtype_bytes


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """megatron_rlvr.models.padded_vocab_size, restated without torch: rows padded to a multiple of divisible_by*tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_params(dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int = 128) -> int:
    """Parameters of one rank of pipeline stage ``stage``: its layers, the vocab-sharded embedding on the first
    stage, the output layer on the last (a tied model's last stage keeps its own copy when pp > 1) and the final
    norm. Equal to the count of megatron-core's build (tests/plan: the meta-device build at TP/PP 1 and 2)."""
    vocab_rows = padded_vocab(dims.vocab, tp, divisible_by) // tp
    count = dims.layers // pp * dims.layer_params(tp)
    if stage == 0:
        count += vocab_rows * dims.hidden
    if stage == pp - 1:
        count += dims.hidden  # final norm
        if not dims.tied or pp > 1:
            count += vocab_rows * dims.hidden
    return count


@functools.lru_cache(maxsize=8)
def teacher_dims(hf_dir: str) -> ModelDims:
    """The teacher's shapes from its config.json (or the copy in configs/models/)."""
    from megatron_rlvr.plan.recipe_files import load_hf_config

    hf = load_hf_config(hf_dir)
    if hf is None:
        raise ConfigError(
            f"algo.teacher_hf_dir={hf_dir!r}: no config.json there or in configs/models/; the plan "
            "needs the teacher's shapes"
        )
    try:
        return ModelDims.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"algo.teacher_hf_dir={hf_dir!r}: config.json lacks a usable shape ({e})") from e
