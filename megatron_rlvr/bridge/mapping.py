"""The one Megatron <-> HF name table for the Llama-family layout (Qwen2, Llama, Qwen3), and the shapes on each
side.

Megatron names here are *global*: ``decoder.layers.{i}`` uses the global layer index, whatever pipeline stage or
virtual chunk holds it. Each entry carries a ``kind`` saying how the tensor is laid out and sharded:

- ``replicated``: the same on every TP rank (RMSNorm weights, Qwen3's per-head q/k norms).
- ``column`` / ``row``: TP-sharded along dim 0 / dim 1, same layout as HF (o_proj, down_proj are ``row``).
- ``vocab``: dim 0 sharded and padded to ``padded_vocab_size`` rows; padding rows are zero and never exported.
- ``qkv``: Megatron interleaves per query group ``[q_g (heads_per_group * d), k_g (d), v_g (d)]``; HF has q/k/v.
- ``gate_up``: Megatron's fc1 shard r is ``[gate_r; up_r]``; HF has gate_proj and up_proj.

Mixture-of-experts layers (Qwen3-MoE) add the router (``replicated``, [experts, hidden]) and, per expert ``e``
(its *global* index, whichever expert-parallel rank holds it), ``gate_up`` and ``row`` entries marked ``expert``:
those are sharded over the expert tensor-parallel group (ETP) instead of TP, and exist only on the EP rank that
owns expert ``e`` (megatron-core's SequentialMLP, ``mlp.experts.local_experts.{j}``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.models.builder import DEFAULT_VOCAB_DIVISIBLE_BY, padded_vocab_size
from megatron_rlvr.models.dims import ModelDims

KINDS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")


@dataclass(frozen=True)
class ParamMapping:
    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: bool = False  # a routed expert's weight: sharded over ETP, held by one EP rank

    @property
    def tp_dim(self) -> int | None:
        return None if self.kind == "replicated" else (1 if self.kind == "row" else 0)


# Transformer Engine fuses the two RMSNorms into the following linear layer; the local spec keeps them apart.
_LOCAL_NORM_NAMES = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
_TE_NORM_NAMES = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")


def mapping_table(dims: ModelDims, te_names: bool = False) -> list[ParamMapping]:
    """Every Megatron parameter of the full model with its HF tensors, in HF checkpoint order.

    ``output_layer.weight`` is listed even for tied embeddings (its HF name, ``lm_head.weight``, is what an
    engine must receive); callers that write an HF checkpoint skip it when ``dims.tied``.
    """
    attn_norm, mlp_norm = _TE_NORM_NAMES if te_names else _LOCAL_NORM_NAMES
    table = [ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(dims.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        table.append(ParamMapping(m + attn_norm, (h + "input_layernorm.weight",), "replicated"))
        table.append(
            ParamMapping(
                m + "self_attention.linear_qkv.weight",
                (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                "qkv",
            )
        )
        if dims.qkv_bias:
            table.append(
                ParamMapping(
                    m + "self_attention.linear_qkv.bias",
                    (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                    "qkv",
                )
            )
        if dims.qk_norm:
            table.append(ParamMapping(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
            table.append(ParamMapping(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
        table.append(ParamMapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
        if i in dims.moe_layers:
            table += _moe_entries(dims, m, h)
            continue
        table.append(ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"))
        table.append(
            ParamMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up")
        )
        table.append(ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"))
    table.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    table.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return table


def _moe_entries(dims: ModelDims, m: str, h: str) -> list[ParamMapping]:
    """One MoE layer's MLP: its norm (never fused into a linear, TE spec or not), router and experts."""
    out = [
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
        ParamMapping(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated"),
    ]
    for e in range(dims.experts):
        me, he = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
        out.append(
            ParamMapping(
                me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "gate_up", expert=True
            )
        )
        out.append(ParamMapping(me + "linear_fc2.weight", (he + "down_proj.weight",), "row", expert=True))
    return out


def hf_shapes(m: ParamMapping, dims: ModelDims) -> list[tuple[int, ...]]:
    """The HF tensors' shapes for one entry, in the order of ``m.hf``."""
    d, H = dims.head_dim, dims.hidden
    if m.expert:
        return [(dims.expert_ffn, H), (dims.expert_ffn, H)] if m.kind == "gate_up" else [(H, dims.expert_ffn)]
    if m.megatron.endswith("mlp.router.weight"):
        return [(dims.experts, H)]
    bias = m.megatron.endswith(".bias")
    if m.kind == "qkv":
        rows = (dims.heads * d, dims.kv_heads * d, dims.kv_heads * d)
        return [(r,) if bias else (r, H) for r in rows]
    if m.kind == "gate_up":
        return [(dims.ffn, H), (dims.ffn, H)]
    if m.kind == "vocab":
        return [(dims.vocab, H)]
    if m.kind == "replicated":
        return [(d,)] if m.megatron.endswith(("q_layernorm.weight", "k_layernorm.weight")) else [(H,)]
    if m.megatron.endswith("linear_proj.weight"):
        return [(H, dims.heads * d)]
    if m.megatron.endswith("linear_fc2.weight"):
        return [(H, dims.ffn)]
    raise KeyError(f"no HF shape rule for {m.megatron} ({m.kind})")


def megatron_full_shape(m: ParamMapping, dims: ModelDims, tp: int, divisible_by: int) -> tuple[int, ...]:
    """The unsharded Megatron tensor's shape (vocab rows padded for this TP size)."""
    shapes = hf_shapes(m, dims)
    if m.kind == "vocab":
        return (padded_vocab_size(dims.vocab, tp, divisible_by), dims.hidden)
    if m.kind in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    return shapes[0]


def megatron_local_shape(
    m: ParamMapping, dims: ModelDims, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
) -> tuple[int, ...]:
    """One shard's shape; ``tp`` is the size of the group that shards ``m`` (ETP for an expert's weight)."""
    full = list(megatron_full_shape(m, dims, tp, divisible_by))
    if m.tp_dim is not None:
        full[m.tp_dim] //= tp
    return tuple(full)
