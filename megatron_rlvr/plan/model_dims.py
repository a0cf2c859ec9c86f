"""The model's shapes as the plan reads them (`ModelDims`, from an HF config.json) and the exact parameter count of
one pipeline stage at a tensor-parallel size, as megatron-core builds it (padded vocabulary included).

Mixture-of-experts models (Qwen3-MoE, docs/moe.md) split a rank's parameters in two: the dense ones (attention,
norms, the router, dense MLP layers, embeddings), cut over TP and replicated over DP x CP, and the experts of its
MoE layers, ``num_experts / ep`` of them on an EP rank, each cut over ETP and replicated over the expert-data-parallel
ranks ((dp x tp x cp) / (ep x etp)). `stage_split` gives both."""

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
    """The shapes of a Qwen2 / Llama / Qwen3 / Qwen3-MoE model that decide its memory, from its HF config.json."""

    hidden: int
    ffn: int  # the dense MLP's intermediate size (the layers a MoE model keeps dense)
    layers: int
    heads: int
    kv_heads: int
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
        from megatron_rlvr.models.family import head_dim, num_kv_heads
        from megatron_rlvr.models.hf_config import family_of

        family = family_of(hf)
        moe = {}
        if hasattr(family, "moe_layer_pattern"):  # qwen3_moe
            moe = dict(
                experts=family.num_experts(hf),
                experts_per_token=int(hf["num_experts_per_tok"]),
                expert_ffn=int(hf["moe_intermediate_size"]),
                moe_pattern=tuple(family.moe_layer_pattern(hf)),
            )
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
            qk_norm=bool(getattr(family, "QK_NORM", False)),
            **moe,
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and any(self.moe_pattern)

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_pattern) and bool(self.moe_pattern[index])

    def moe_layers_of(self, pp: int, stage: int) -> int:
        """MoE layers of pipeline stage ``stage`` (megatron gives each stage a contiguous block of layers)."""
        per = self.layers // pp
        return sum(self.is_moe_layer(i) for i in range(stage * per, (stage + 1) * per))

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


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """megatron_rlvr.models.padded_vocab_size, restated without torch: rows padded to a multiple of divisible_by*tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_split(
    dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int = 128, ep: int = 1, etp: int = 1
) -> tuple[int, int]:
    """(dense, expert) parameters of one rank of pipeline stage ``stage``. Dense: its layers' attention and norms,
    the dense layers' MLPs and the MoE layers' routers, the vocab-sharded embedding on the first stage, the output
    layer on the last (a tied model's last stage keeps its own copy when pp > 1) and the final norm. Expert: the
    ``experts / ep`` local experts of each of its MoE layers, cut over ETP."""
    vocab_rows = padded_vocab(dims.vocab, tp, divisible_by) // tp
    moe_layers = dims.moe_layers_of(pp, stage)
    dense_layers = dims.layers // pp - moe_layers
    dense = dense_layers * dims.layer_params(tp) + moe_layers * dims.moe_layer_dense_params(tp)
    if stage == 0:
        dense += vocab_rows * dims.hidden
    if stage == pp - 1:
        dense += dims.hidden  # final norm
        if not dims.tied or pp > 1:
            dense += vocab_rows * dims.hidden
    expert = moe_layers * (dims.experts // ep) * dims.expert_params(etp) if moe_layers else 0
    return dense, expert


def stage_params(
    dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int = 128, ep: int = 1, etp: int = 1
) -> int:
    """Parameters of one rank of pipeline stage ``stage`` (dense + expert, `stage_split`). Equal to the count of
    megatron-core's build (tests/plan: the meta-device build at TP/PP 1 and 2, and a MoE at EP 2)."""
    return sum(stage_split(dims, tp, pp, stage, divisible_by, ep, etp))


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
