"""Post-sync check: read the weights back out of a vLLM model and compare them with the HF tensors that were sent.

Runs inside the engine's worker (through ``apply_model``), on that worker's tensor-parallel shard. It knows vLLM's
layout for the Llama/Qwen2 family: q/k/v packed into ``qkv_proj`` and gate/up into ``gate_up_proj`` (each part cut to
this rank's heads/rows), ``o_proj``/``down_proj`` split along the input dim, vocabulary rows padded and split.

A matrix is read back as the layer *computes* with it, not from its ``weight`` attribute: vLLM-CPU packs linear
weights into oneDNN handles and leaves ``weight`` empty, and a tied output layer keeps its own packed copy (the one
that goes stale). Feeding the identity through the layer's own GEMM returns W^T exactly (products with 1 and 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def unreadable(hf_config: Mapping) -> str | None:
    """Why this model's weights cannot be read back (None: they can). Routed experts live in vLLM's fused-MoE
    buffers, which its CPU kernel prepacks into its own layout, with no linear layer to read them through."""
    if hf_config.get("num_experts") or hf_config.get("num_local_experts"):  # transformers 5 writes the latter
        return "a mixture-of-experts model's experts are held prepacked by vLLM's fused MoE"
    return None


_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def compare_model_weights(
    model: torch.nn.Module, sent: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int, atol: float = 0.0
) -> list[str]:
    """Names of the sent tensors whose engine copy differs (by more than ``atol``), each with the max difference."""
    params = _EffectiveWeights(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mismatches: list[str] = []
    for name, tensor in sent.items():
        try:
            engine_part, expected = _engine_view(name, tensor, params, cfg, head_dim, tp_rank, tp_size)
        except KeyError as e:
            mismatches.append(f"{name}: no engine parameter found ({e})")
            continue
        expected = expected.to(engine_part.device, engine_part.dtype)
        if engine_part.shape != expected.shape:
            mismatches.append(f"{name}: engine holds shape {tuple(engine_part.shape)}, sent {tuple(expected.shape)}")
            continue
        diff = (engine_part - expected).abs().max().item() if expected.numel() else 0.0
        if diff > atol:
            mismatches.append(f"{name}: max |engine - sent| = {diff:.3g}")
    return mismatches


def _engine_view(name, tensor, params, cfg, head_dim, tp_rank, tp_size):
    """(slice of the engine parameter holding ``name``'s values on this rank, the matching slice of ``tensor``)."""
    prefix, module, leaf = _split(name)
    if module in _PACKED:
        packed, index = _PACKED[module]
        param = params[f"{prefix}{packed}.{leaf}"]
        sizes = _packed_sizes(packed, cfg, head_dim, tp_size)
        start = sum(sizes[:index])
        engine_part = param.narrow(0, start, sizes[index])
        if module in ("k_proj", "v_proj"):
            expected = _kv_shard(tensor, cfg.num_key_value_heads, head_dim, tp_rank, tp_size)
        else:
            expected = tensor.chunk(tp_size, dim=0)[tp_rank]
        return engine_part, expected
    param = params[name] if name in params else params[f"{prefix}{module}.{leaf}"]
    if module in _ROW_PARALLEL and leaf == "weight":
        return param, tensor.chunk(tp_size, dim=1)[tp_rank]
    if module in _VOCAB:
        rows_per_rank = param.shape[0]
        first = tp_rank * rows_per_rank
        valid = max(0, min(rows_per_rank, tensor.shape[0] - first))
        return param.narrow(0, 0, valid), tensor.narrow(0, first, valid)
    return param, tensor


def _split(name: str) -> tuple[str, str, str]:
    """'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn.', 'q_proj', 'weight')."""
    parts = name.split(".")
    if len(parts) < 2:
        raise KeyError(name)
    return ".".join(parts[:-2]) + ("." if len(parts) > 2 else ""), parts[-2], parts[-1]


def _packed_sizes(packed: str, cfg, head_dim: int, tp_size: int) -> list[int]:
    if packed == "qkv_proj":
        q = cfg.num_attention_heads * head_dim // tp_size
        kv = max(1, cfg.num_key_value_heads // tp_size) * head_dim
        return [q, kv, kv]
    inter = cfg.intermediate_size // tp_size
    return [inter, inter]


def _kv_shard(tensor: torch.Tensor, kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if kv_heads >= tp_size:
        return tensor.chunk(tp_size, dim=0)[tp_rank]
    # Fewer KV heads than ranks: vLLM replicates each KV head over tp_size // kv_heads consecutive ranks.
    head = tp_rank // (tp_size // kv_heads)
    return tensor.narrow(0, head * head_dim, head_dim)


class _EffectiveWeights:
    """``name -> tensor`` of a vLLM model, matrices of GEMM layers read back through the layer's own kernel."""

    _IDENTITY_ROWS = 1024  # identity rows per GEMM call: bounds the scratch memory for wide layers

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.cache: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.params or self._gemm_module(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            module = self._gemm_module(name)
            if module is None:
                self.cache[name] = self.params[name]
            else:
                self.cache[name] = self._read_gemm(module)
        return self.cache[name]

    def _gemm_module(self, name: str):
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        module_name, _, leaf = name.rpartition(".")
        if leaf != "weight":
            return None
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, (LinearBase, ParallelLMHead)) else None

    def _read_gemm(self, module: torch.nn.Module) -> torch.Tensor:
        from vllm.model_executor.layers.linear import LinearBase

        in_features = module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim
        device, dtype = _device_dtype(module)
        columns = []
        for start in range(0, in_features, self._IDENTITY_ROWS):
            rows = min(self._IDENTITY_ROWS, in_features - start)
            eye = torch.zeros(rows, in_features, device=device, dtype=dtype)
            eye[:, start : start + rows] = torch.eye(rows, device=device, dtype=dtype)
            columns.append(module.quant_method.apply(module, eye, None).t())  # [out, rows] = W[:, start:start+rows]
        return torch.cat(columns, dim=1)


def _device_dtype(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    raise KeyError(f"{type(module).__name__} holds no floating tensor")
