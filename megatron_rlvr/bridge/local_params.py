"""This rank's Megatron parameters under their global names (``decoder.layers.{global i}``, and
``mlp.experts.local_experts.{global expert}``), from the model chunks (plain GPTModel, or wrapped by megatron's DDP /
Float16Module), and their mapping entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.bridge.mapping import ParamMapping, mapping_table, megatron_local_shape
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.lora import A_NAME, B_NAME


class BridgeError(ValueError):
    """A Megatron tensor is missing or mis-shaped for the HF mapping; the message names the tensor."""


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def as_chunks(model_chunks) -> list[torch.nn.Module]:
    if isinstance(model_chunks, torch.nn.Module):
        return [unwrap(model_chunks)]
    return [unwrap(m) for m in model_chunks]


def global_named_params(model_chunks) -> dict[str, torch.Tensor]:
    """``{global megatron name: parameter}`` over all chunks of this rank."""
    out: dict[str, torch.Tensor] = {}
    for chunk in as_chunks(model_chunks):
        layer_ids = {}
        if hasattr(chunk, "decoder"):
            layer_ids = {str(i): layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        for name, param in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                if parts[4:6] == ["experts", "local_experts"]:  # local expert j -> its global index
                    local = len(chunk.decoder.layers[int(parts[2])].mlp.experts.local_experts)
                    parts[6] = str(_expert_rank() * local + int(parts[6]))
                parts[2] = str(layer_ids[parts[2]])
            out[".".join(parts)] = param
    return out


def _expert_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def is_adapter(name: str) -> bool:
    """A LoRA adapter's half (models/lora.py): exported merged into its base weight, or on its own (peft.py)."""
    return name.rsplit(".", 1)[-1] in (A_NAME, B_NAME)


def uses_te_names(params: dict[str, torch.Tensor]) -> bool:
    return any(n.endswith("layer_norm_weight") for n in params)


@dataclass
class LocalEntry:
    mapping: ParamMapping
    param: torch.Tensor | None  # None: not on this rank (another pipeline stage, or tied output layer at PP=1)


def local_entries(model_chunks, dims: ModelDims, tp: int) -> tuple[list[LocalEntry], list[str]]:
    """The mapping table with this rank's parameter for each entry, and shape/unknown-name problems found (LoRA
    adapters are not the model's parameters: see bridge/lora_merge.py)."""
    params = {n: p for n, p in global_named_params(model_chunks).items() if not is_adapter(n)}
    table = mapping_table(dims, te_names=uses_te_names(params))
    known = {m.megatron for m in table}
    problems = [f"{n}: Megatron parameter with no HF mapping" for n in sorted(set(params) - known)]
    entries = []
    for m in table:
        p = params.get(m.megatron)
        if p is not None:
            expected = megatron_local_shape(m, dims, shard_rank_and_size(m, tp)[1])
            if m.kind == "vocab":  # padding depends on the divisor knob: any row count covering the vocab works
                ok = p.dim() == 2 and p.shape[1] == dims.hidden and p.shape[0] * tp >= dims.vocab
            else:
                ok = tuple(p.shape) == expected
            if not ok:
                where = f"ETP={shard_rank_and_size(m, tp)[1]}" if m.expert else f"TP={tp}"
                problems.append(f"{m.megatron}: local shape {list(p.shape)}, expected {list(expected)} at {where}")
        entries.append(LocalEntry(m, p))
    return entries, problems


def tp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def shard_rank_and_size(m: ParamMapping, tp: int = 0) -> tuple[int, int]:
    """(rank, size) of the group that shards ``m``: expert tensor parallel for an expert's weight, else TP (``tp``
    given: just the size is wanted for a TP entry, and it is ``tp``)."""
    from megatron.core import parallel_state as ps

    if m.expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return (0, tp) if tp else tp_rank_and_size()


def experts_laid_out_apart(tp: int) -> bool:
    """Whether experts are cut otherwise than the TP group cuts the rest (EP > 1, or ETP != TP)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() != tp
