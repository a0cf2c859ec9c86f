"""LoRA adapters merged into their base weights as the export reads them: ``W + (alpha / r) B A``, one shard at a time.

Each rank merges its own shards: a column-parallel weight's rows ``W_r`` take ``B_r A`` (B split like W, A whole), a
row-parallel weight's columns take ``B A_r`` (A split like W, B whole), so a merged shard is exactly the shard of the
merged weight and the export then gathers and re-lays it out like any other. The product is taken in float64 and the
sum rounded once to the weight's dtype: the result equals ``W + (alpha / r) B A`` computed in float64 from the whole
tensors and rounded, bit for bit. Nothing is merged before the export asks for a tensor, and nothing is kept after
it: a sync stages no merged model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from megatron_rlvr.bridge.local_params import BridgeError, global_named_params, is_adapter
from megatron_rlvr.models.lora import A_NAME, B_NAME


def adapter_pairs(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A, B)}`` of every adapted linear among ``params`` (global or local names alike)."""
    pairs = {}
    for name, a in params.items():
        if name.endswith("." + A_NAME):
            stem = name[: -len(A_NAME) - 1]
            b = params.get(f"{stem}.{B_NAME}")
            if b is None or f"{stem}.weight" not in params:
                raise BridgeError(f"{name}: a LoRA half without its {B_NAME} or its base weight")
            pairs[f"{stem}.weight"] = (a, b)
    return pairs


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a`` in float64, rounded once to ``weight``'s dtype (a new tensor)."""
    with torch.no_grad():
        return torch.addmm(weight.double(), b.double(), a.double(), alpha=scale).to(weight.dtype)


class MergedParams(Mapping[str, torch.Tensor]):
    """This rank's parameters by name with every adapted weight merged when it is read (the adapters' own halves
    are not among the names). Reading a name twice merges twice: the export reads each once per call."""

    def __init__(self, params: Mapping[str, torch.Tensor], scale: float) -> None:
        self.params = {n: p for n, p in params.items() if not is_adapter(n)}
        self.pairs = adapter_pairs(params)
        self.scale = scale

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self.params[name]
        pair = self.pairs.get(name)
        return weight if pair is None else merged(weight.detach(), pair[0].detach(), pair[1].detach(), self.scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def with_adapters(
    model_chunks, by_name: dict[str, torch.Tensor], lora_scale: float | None
) -> Mapping[str, torch.Tensor]:
    """The export's parameters ``by_name``, or their merged view when the model carries adapters (which
    ``lora_scale`` = alpha / r must then scale: exporting the bare base of an adapted model is refused)."""
    adapters = {n: p for n, p in global_named_params(model_chunks).items() if is_adapter(n)}
    if not adapters:
        return by_name
    if lora_scale is None:
        raise BridgeError(
            f"weight export: the model carries LoRA adapters ({next(iter(adapters))}, ...); pass lora_scale "
            "(alpha / rank) to export them merged"
        )
    return MergedParams(by_name | adapters, lora_scale)
