"""Post-sync check: read the weights back out of a vLLM model and compare them with the HF tensors that were sent.

Runs inside the engine's worker (through ``apply_model``), on that worker's tensor-parallel shard. Which slice of
each HF tensor the rank holds is the bridge's `engine_shard_region` (vLLM's partitioning, stated once); this module
adds only where vLLM keeps it: q/k/v packed into ``qkv_proj`` and gate/up into ``gate_up_proj``, vocabulary rows
first in a padded partition.

A matrix is read back as the layer *computes* with it, not from its ``weight`` attribute: vLLM-CPU packs linear
weights into oneDNN handles and leaves ``weight`` empty, and a tied output layer keeps its own packed copy (the one
that goes stale). Feeding the identity through the layer's own GEMM returns W^T exactly (products with 1 and 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_rlvr.bridge.reshard import engine_shard_region, rule_of
from megatron_rlvr.models.dims import ModelDims


def unreadable(dims: ModelDims) -> str | None:
    """Why this model's weights cannot be read back (None: they can). Routed experts live in vLLM's fused-MoE
    buffers, which its CPU kernel prepacks into its own layout, with no linear layer to read them through."""
    if dims.is_moe:
        return "a mixture-of-experts model's experts are held prepacked by vLLM's fused MoE"
    return None


# vLLM packs these HF tensors, in this order, into one parameter along dim 0 (each part cut to this rank first)
_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PACKED_INTO = {part: packed for packed, parts in _PACKED.items() for part in parts}


def compare_model_weights(
    model: torch.nn.Module,
    sent: Mapping[str, torch.Tensor],
    dims: ModelDims,
    tp_rank: int,
    tp_size: int,
    atol: float = 0.0,
) -> list[str]:
    """Names of the sent tensors whose engine copy differs (by more than ``atol``), each with the max difference."""
    params = _EffectiveWeights(model)
    mismatches: list[str] = []
    for name, tensor in sent.items():
        try:
            engine_part, expected = _engine_view(name, tensor, params, dims, tp_rank, tp_size)
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


def _engine_view(name, tensor, params, dims: ModelDims, tp_rank: int, tp_size: int):
    """(slice of the engine parameter holding ``name``'s values on this rank, the matching slice of ``tensor``): the
    rank's slice is the bridge's `engine_shard_region`, the one statement of vLLM's partitioning."""
    dim, start, length = engine_shard_region(name, tensor.shape, dims, tp_size, tp_rank)
    expected = tensor if dim is None else tensor.narrow(dim, start, length)
    prefix, module, leaf = _split(name)
    packed = _PACKED_INTO.get(module)
    if packed is not None:
        parts = _PACKED[packed]
        offset = sum(_rows_here(f"{prefix}{p}.{leaf}", dims, tp_rank, tp_size) for p in parts[: parts.index(module)])
        return params[f"{prefix}{packed}.{leaf}"].narrow(0, offset, length), expected
    param = params[name]
    if rule_of(name) == "vocab":  # vLLM pads the vocabulary: this rank's real rows come first in its partition
        return param.narrow(0, 0, length), expected
    return param, expected


def _rows_here(hf_name: str, dims: ModelDims, tp_rank: int, tp_size: int) -> int:
    """Rows of HF tensor ``hf_name`` (a q/k/v or gate/up part) that this engine rank keeps."""
    rows = {"q_proj": dims.q_width, "k_proj": dims.kv_width, "v_proj": dims.kv_width}.get(_split(hf_name)[1], dims.ffn)
    return engine_shard_region(hf_name, (rows,), dims, tp_size, tp_rank)[2]


def _split(name: str) -> tuple[str, str, str]:
    """'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn.', 'q_proj', 'weight')."""
    parts = name.split(".")
    if len(parts) < 2:
        raise KeyError(name)
    return ".".join(parts[:-2]) + ("." if len(parts) > 2 else ""), parts[-2], parts[-1]


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
