"""The slice of a full HF tensor that one rank of a vLLM engine at tensor-parallel size ``tp`` keeps.

An engine on ranks of its own receives every HF tensor whole (``rollout/transfer.py``) and keeps only its shard, so
the actor's (TP, PP) and the engine's TP are independent. The partitioning is vLLM's own (0.32, read from
``vllm/model_executor/layers``), for the names ``mapping.mapping_table`` produces (Qwen2 and Llama):

- q_proj (weight and bias): ``QKVParallelLinear.weight_loader``: rows of ``heads / tp`` whole heads at rank r.
- k_proj, v_proj: the same loader. With ``kv_heads >= tp`` each rank takes ``kv_heads / tp`` heads; with fewer kv
  heads than ranks each kv head is replicated on ``tp / kv_heads`` consecutive ranks (``num_kv_head_replicas``):
  rank r takes head ``r // replicas``. vLLM's ``divide`` requires the quotient to be whole either way.
- gate_proj, up_proj: ``MergedColumnParallelLinear.weight_loader``: rows ``ffn / tp``.
- o_proj, down_proj: ``RowParallelLinear.weight_loader``: columns (the input dim) ``in / tp``.
- embed_tokens, lm_head: ``VocabParallelEmbedding._get_indices`` / ``weight_loader``: the vocabulary padded up to a
  multiple of 64 (``pad_vocab_size``, ``DEFAULT_VOCAB_PADDING_SIZE``), split in ``padded / tp`` rows per rank; rank r
  loads the real rows ``[min(r*n, V), min((r+1)*n, V))`` and zero-fills the rest of its partition. The shard
  returned here is those real rows only (possibly none), so the ranks' shards concatenate back to the HF tensor.
- RMSNorm weights: replicated (the whole tensor on every rank); Qwen3's per-head ``q_norm`` / ``k_norm`` too.
- Qwen3-MoE's router (``mlp.gate.weight``, vLLM's ``GateLinear``, a replicated linear): the whole on every rank.
- Routed experts (``mlp.experts.{e}.gate_proj/up_proj/down_proj``, vLLM's fused-MoE ``RoutedExperts`` loader,
  ``make_expert_params_mapping``: gate -> w1, up -> w3, down -> w2). Without expert parallelism every rank holds every
  expert, cut as ``_load_w13`` / ``_load_w2`` cut them: gate/up rows ``moe_ffn / tp`` at rank r, down columns the
  same. With vLLM's expert parallelism (``enable_expert_parallel``; the MoE layers then run at TP 1 and EP = the
  engine's TP, ``FusedMoEParallelConfig.make``) rank r holds its experts whole and no other: the "linear" placement
  of ``determine_expert_map`` (``E // ep`` each, the first ``E % ep`` ranks one more). ``ep=True`` below.

Rows of a dim-0 slice of a contiguous tensor are a contiguous view; o_proj/down_proj columns are a strided view.
"""

from __future__ import annotations

import re

import torch

from megatron_rlvr.bridge.local_params import BridgeError
from megatron_rlvr.errors import UserError
from megatron_rlvr.models.dims import ModelDims

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE

_LAYER = r"model\.layers\.\d+\."
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(rf"{_LAYER}self_attn\.q_proj\.(weight|bias)"), "q"),
    (re.compile(rf"{_LAYER}self_attn\.[kv]_proj\.(weight|bias)"), "kv"),
    (re.compile(rf"{_LAYER}self_attn\.o_proj\.weight"), "o"),
    (re.compile(rf"{_LAYER}mlp\.(gate|up)_proj\.weight"), "gate_up"),
    (re.compile(rf"{_LAYER}mlp\.down_proj\.weight"), "down"),
    (re.compile(r"model\.embed_tokens\.weight|lm_head\.weight"), "vocab"),
    (re.compile(rf"{_LAYER}(input_layernorm|post_attention_layernorm)\.weight|model\.norm\.weight"), "replicated"),
    (re.compile(rf"{_LAYER}self_attn\.[qk]_norm\.weight"), "qk_norm"),
    (re.compile(rf"{_LAYER}mlp\.gate\.weight"), "router"),
    (re.compile(rf"{_LAYER}mlp\.experts\.\d+\.(gate|up)_proj\.weight"), "expert_gate_up"),
    (re.compile(rf"{_LAYER}mlp\.experts\.\d+\.down_proj\.weight"), "expert_down"),
]
_EXPERT_INDEX = re.compile(r".*\.mlp\.experts\.(\d+)\.")


class ReshardError(BridgeError, UserError):
    """An engine TP that vLLM cannot partition a tensor for, or a tensor that is not the shape the model's config
    says; the message names the tensor and the sizes."""


def rule_of(hf_name: str) -> str:
    """Which partitioning rule ``hf_name`` follows ("q", "kv", "o", "gate_up", "down", "vocab", "replicated",
    "qk_norm", "router", "expert_gate_up", "expert_down")."""
    for pattern, rule in _RULES:
        if pattern.fullmatch(hf_name):
            return rule
    raise ReshardError(
        f"{hf_name}: no engine partitioning rule for this name (Qwen2/Llama/Qwen3/Qwen3-MoE HF names expected)"
    )


def _whole(hf_name: str, what: str, total: int, tp: int) -> int:
    """``total / tp``, or an error naming the tensor: vLLM's ``divide`` asserts the same."""
    if tp < 1 or total % tp:
        raise ReshardError(f"{hf_name}: engine tp={tp} does not divide its {total} {what} (vLLM splits them evenly)")
    return total // tp


def vocab_range(vocab: int, tp: int, rank: int, hf_name: str = "vocab") -> tuple[int, int]:
    """The real vocabulary rows ``[start, stop)`` engine TP rank ``rank`` loads (``VocabParallelEmbedding``)."""
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    per_rank = _whole(hf_name, f"vocabulary rows after vLLM's padding of {vocab} to {padded}", padded, tp)
    return min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab)


def kv_heads_of_rank(dims: ModelDims, tp: int, rank: int, hf_name: str = "k_proj") -> tuple[int, int]:
    """The kv heads ``[first, first + count)`` engine TP rank ``rank`` holds (``QKVParallelLinear``)."""
    if tp >= dims.kv_heads:
        if tp % dims.kv_heads:
            raise ReshardError(
                f"{hf_name}: engine tp={tp} is not a multiple of its {dims.kv_heads} kv heads (vLLM "
                f"replicates each kv head on tp / kv_heads ranks when there are fewer than tp)"
            )
        return rank // (tp // dims.kv_heads), 1
    per_rank = _whole(hf_name, "kv heads", dims.kv_heads, tp)
    return rank * per_rank, per_rank


def _expect(hf_name: str, shape: tuple[int, ...], dim: int, size: int, what: str) -> None:
    if len(shape) <= dim or shape[dim] != size:
        raise ReshardError(
            f"{hf_name}: shape {list(shape)}, expected {size} {what} along dim {dim} from the model's config"
        )


def expert_ranks(experts: int, ep: int) -> list[range]:
    """The experts each rank of vLLM's expert parallelism holds (``determine_expert_map``'s "linear" placement)."""
    base, extra = divmod(experts, ep)
    starts = [r * base + min(r, extra) for r in range(ep + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(ep)]


def engine_shard_region(
    hf_name: str, full_shape: tuple[int, ...] | torch.Size, dims: ModelDims, tp: int, rank: int, ep: bool = False
) -> tuple[int | None, int, int]:
    """Where engine TP rank ``rank`` of ``tp``'s slice of HF tensor ``hf_name`` lies in the full tensor, in vLLM's
    partitioning (see the module docstring): (dim, start, length), dim None for a replicated tensor (the whole).
    ``ep``: vLLM's expert parallelism over the ``tp`` ranks; an expert another rank holds is (0, 0, 0): nothing."""
    if not 0 <= rank < tp:
        raise ReshardError(f"{hf_name}: engine tp rank {rank} is not in [0, {tp})")
    shape = tuple(full_shape)
    rule = rule_of(hf_name)
    d = dims.head_dim
    if rule == "replicated":
        _expect(hf_name, shape, 0, dims.hidden, "hidden units")
        return None, 0, shape[0]
    if rule == "qk_norm":
        _expect(hf_name, shape, 0, d, "units (head_dim)")
        return None, 0, shape[0]
    if rule == "router":
        _expect(hf_name, shape, 0, dims.experts, "rows (experts)")
        return None, 0, shape[0]
    if rule in ("expert_gate_up", "expert_down"):
        dim = 0 if rule == "expert_gate_up" else 1
        _expect(hf_name, shape, dim, dims.expert_ffn, "rows (moe_intermediate_size)" if dim == 0 else "columns")
        if ep:
            expert = int(_EXPERT_INDEX.match(hf_name).group(1))
            return (None, 0, shape[0]) if expert in expert_ranks(dims.experts, tp)[rank] else (0, 0, 0)
        size = _whole(hf_name, "moe_intermediate_size units", dims.expert_ffn, tp)
        return dim, rank * size, size
    if rule == "q":
        _expect(hf_name, shape, 0, dims.heads * d, "rows (heads x head_dim)")
        rows = _whole(hf_name, "attention heads", dims.heads, tp) * d
        return 0, rank * rows, rows
    if rule == "kv":
        _expect(hf_name, shape, 0, dims.kv_heads * d, "rows (kv heads x head_dim)")
        first, count = kv_heads_of_rank(dims, tp, rank, hf_name)
        return 0, first * d, count * d
    if rule == "o":
        _expect(hf_name, shape, 1, dims.heads * d, "columns (heads x head_dim)")
        cols = _whole(hf_name, "attention heads", dims.heads, tp) * d
        return 1, rank * cols, cols
    if rule == "gate_up":
        _expect(hf_name, shape, 0, dims.ffn, "rows (intermediate size)")
        rows = _whole(hf_name, "rows (intermediate size)", dims.ffn, tp)
        return 0, rank * rows, rows
    if rule == "down":
        _expect(hf_name, shape, 1, dims.ffn, "columns (intermediate size)")
        cols = _whole(hf_name, "columns (intermediate size)", dims.ffn, tp)
        return 1, rank * cols, cols
    _expect(hf_name, shape, 0, dims.vocab, "vocabulary rows")
    start, stop = vocab_range(dims.vocab, tp, rank, hf_name)
    return 0, start, stop - start


def engine_shard(
    hf_name: str, tensor: torch.Tensor, dims: ModelDims, tp: int, rank: int, ep: bool = False
) -> torch.Tensor:
    """The slice of full HF tensor ``hf_name`` that engine TP rank ``rank`` of ``tp`` keeps, in vLLM's partitioning
    (see the module docstring): a view of ``tensor`` (rows, columns, the whole of it, or none of it: an expert
    another rank holds under ``ep``)."""
    dim, start, length = engine_shard_region(hf_name, tensor.shape, dims, tp, rank, ep)
    return tensor if dim is None else tensor.narrow(dim, start, length)


def engine_tp_problems(dims: ModelDims, tp: int, ep: bool = False) -> list[str]:
    """Why vLLM cannot run this model at TP ``tp`` (empty: it can); checked before any weight moves."""
    problems = []
    if tp < 1:
        return [f"engine tp={tp}: expected >= 1"]
    if dims.experts and tp > dims.experts:  # Qwen3MoeSparseMoeBlock refuses it
        problems.append(f"engine tp={tp} is greater than the {dims.experts} experts")
    if dims.experts and not ep and dims.expert_ffn % tp:
        problems.append(f"engine tp={tp} does not divide the experts' intermediate size {dims.expert_ffn}")
    if dims.heads % tp:
        problems.append(f"engine tp={tp} does not divide the {dims.heads} attention heads")
    if (dims.kv_heads % tp) if tp < dims.kv_heads else (tp % dims.kv_heads):
        problems.append(f"engine tp={tp} and the {dims.kv_heads} kv heads: one must divide the other")
    if dims.ffn % tp:
        problems.append(f"engine tp={tp} does not divide the intermediate size {dims.ffn}")
    padded = -(-dims.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        problems.append(f"engine tp={tp} does not divide the vocabulary padded to {padded} (from {dims.vocab})")
    return problems
