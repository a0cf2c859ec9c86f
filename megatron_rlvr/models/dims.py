"""`ModelDims`: the one home of a model's shapes (hidden size, heads, KV heads, head size, layers, vocabulary, tied
embeddings, biases, q/k norms, routed experts), built from an HF config through its family.

Everything that needs a shape reads it here: the layout check (layout.py), the bridge's name table and its engine
shards, the rollout engines, the memory plan. The parameter counts below are megatron-core's build of those shapes
on one rank (the plan's input; tests/integration/plan checks them against a meta-device build).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_rlvr.models.family import head_dim, num_kv_heads
from megatron_rlvr.models.hf_config import family_of


@dataclass(frozen=True)
class ModelDims:
    """A Qwen2 / Llama / Qwen3 / Qwen3-MoE model's shapes, from its HF config.json."""

    hidden: int
    ffn: int  # the dense MLP's intermediate size (the layers a MoE model keeps dense)
    layers: int
    heads: int
    kv_heads: int  # megatron's query groups
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm on q and on k, head_dim values each, every TP rank whole
    experts: int = 0  # routed experts of one MoE layer (0: a dense model)
    experts_per_token: int = 0  # top-k
    expert_ffn: int = 0  # one expert's SwiGLU intermediate size (moe_intermediate_size)
    moe_pattern: tuple[int, ...] = ()  # per layer: 1 MoE, 0 dense (empty: every layer dense)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelDims:
        family = family_of(hf)
        moe = family.moe_shape(hf)
        return cls(
            hidden=int(hf["hidden_size"]),
            ffn=int(hf["intermediate_size"]),
            layers=int(hf["num_hidden_layers"]),
            heads=int(hf["num_attention_heads"]),
            kv_heads=num_kv_heads(hf),
            head_dim=head_dim(hf),
            vocab=int(hf["vocab_size"]),
            tied=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(family.QKV_BIAS),
            qk_norm=bool(family.QK_NORM),
            experts=moe.experts,
            experts_per_token=moe.experts_per_token,
            expert_ffn=moe.expert_ffn,
            moe_pattern=moe.pattern,
        )

    # --- shapes derived from the fields ------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and any(self.moe_pattern)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the layers with experts (the others have a dense MLP)."""
        return tuple(i for i, moe in enumerate(self.moe_pattern) if moe)

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_pattern) and bool(self.moe_pattern[index])

    def moe_layers_of(self, pp: int, stage: int) -> int:
        """MoE layers of pipeline stage ``stage`` (megatron gives each stage a contiguous block of layers)."""
        per = self.layers // pp
        return sum(self.is_moe_layer(i) for i in range(stage * per, (stage + 1) * per))

    # --- parameter counts on one rank, as megatron-core builds them ----------------------------------------------
    def attention_params(self, tp: int) -> int:
        """One layer's attention and its two RMSNorms on one TP rank: QKV (+ bias) and the output projection cut
        over TP; the norms (and Qwen3's q/k norms) whole on every rank."""
        qkv = self.q_width + 2 * self.kv_width
        sharded = self.hidden * qkv + (qkv if self.qkv_bias else 0) + self.q_width * self.hidden
        return sharded // tp + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def layer_params(self, tp: int) -> int:
        """One dense transformer layer's parameters on one TP rank: attention, norms and SwiGLU fc1/fc2 (cut over
        TP)."""
        return self.attention_params(tp) + 3 * self.hidden * self.ffn // tp

    def router_params(self) -> int:
        """One MoE layer's router, [experts, hidden], replicated over TP (a dense parameter)."""
        return self.experts * self.hidden

    def expert_params(self, etp: int) -> int:
        """One expert's SwiGLU fc1/fc2 (no biases) on one ETP rank."""
        return 3 * self.hidden * self.expert_ffn // etp

    def moe_layer_dense_params(self, tp: int) -> int:
        return self.attention_params(tp) + self.router_params()

    def hf_params(self) -> int:
        """The checkpoint's parameter count (unpadded vocabulary): what an engine holds in total."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.layers))
        dense_layers = self.layers - moe_layers
        moe = moe_layers * (self.moe_layer_dense_params(1) + self.experts * self.expert_params(1))
        return embeddings + dense_layers * self.layer_params(1) + moe + self.hidden

    def active_params(self) -> int:
        """Parameters one token passes through (the top-k experts of each MoE layer; all of a dense model)."""
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.layers))
        idle = moe_layers * (self.experts - self.experts_per_token) * self.expert_params(1)
        return self.hf_params() - idle

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers (the engine's KV cache, before its TP split)."""
        return 2 * self.layers * self.kv_width * dtype_bytes
