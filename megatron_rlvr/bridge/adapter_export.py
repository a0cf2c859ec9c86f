"""The LoRA adapters alone, streamed in PEFT's names and layout (bridge/peft.py), at any (TP, PP).

For each adapted linear, in the HF checkpoint's order, the pipeline stage that holds it gathers the half split over TP
(B of a column-parallel linear, A of a row-parallel one: models/lora.py) and re-lays it out as the base weight's rows
or columns are (de-interleaved q/k/v, gate/up apart: bridge/layout.py); the whole half is the same on every TP rank.
Stages that do not hold the linear receive its tensors by broadcast, so every rank of the model-parallel group that
iterates the export gets every bucket; it is a collective over that group, like ``export_hf_weights``. The tensors
are fresh (a consumer may keep them). Routed experts' adapters are refused: their PEFT names on vLLM's and
transformers' fused experts were not checked here (their merged weights go through ``export_hf_weights``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.bridge.layout import to_hf
from megatron_rlvr.bridge.local_params import BridgeError, global_named_params, is_adapter, uses_te_names
from megatron_rlvr.bridge.mapping import ParamMapping, hf_shapes, mapping_table
from megatron_rlvr.bridge.peft import peft_name
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.lora import A_NAME, B_NAME, COLUMN_LINEARS, split_dim

DEFAULT_BUCKET_BYTES = 256 << 20


def _halves(m: ParamMapping, rank: int, dims: ModelDims) -> list[tuple[str, list[tuple[str, tuple[int, int]]]]]:
    """(half, [(PEFT name, shape)]) of the adapter on the linear whose base weight maps as ``m``."""
    shapes = hf_shapes(m, dims)
    names_a = [(peft_name(h, A_NAME), (rank, s[1])) for h, s in zip(m.hf, shapes)]
    names_b = [(peft_name(h, B_NAME), (s[0], rank)) for h, s in zip(m.hf, shapes)]
    return [(A_NAME, names_a), (B_NAME, names_b)]


def _gathered(local: torch.Tensor, dim: int | None, group, size: int) -> torch.Tensor:
    """The whole half over the TP group (Megatron's order along ``dim``)."""
    if dim is None or size == 1:
        return local.detach().clone()
    flat = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(flat, local.detach().contiguous().view(-1), group=group)
    return torch.cat(list(flat.view(size, *local.shape)), dim=dim)


def _relaid(m: ParamMapping, half: str, whole: torch.Tensor, names: list[str], dims: ModelDims, tp: int):
    """The PEFT tensors of one half: a split B re-laid out like the base weight's rows; a shared A repeated."""
    if half == B_NAME and len(names) > 1:
        return [(n, t.contiguous()) for n, (_, t) in zip(names, to_hf(m, whole, dims, tp))]
    return [(n, whole if i == 0 else whole.clone()) for i, n in enumerate(names)]  # PEFT: one A per module


@torch.no_grad()
def export_adapter(
    model_chunks, hf: Mapping[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(PEFT name, tensor)`` of every adapter, on every rank of the model-parallel group (a
    collective: iterate to the end). A bucket exceeds ``bucket_bytes`` only when one tensor does."""
    from megatron.core import parallel_state as ps

    dims = ModelDims.from_hf(hf)
    params = global_named_params(model_chunks)
    adapters = {n: p for n, p in params.items() if is_adapter(n)}
    if any(".experts." in n for n in adapters):
        raise BridgeError(
            "adapter export: routed experts' adapters have no checked PEFT layout here; use actor.lora.sync=merged"
        )
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp, pp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    mine = {
        n[: -len(A_NAME) - 1]: (adapters[n].shape[0], str(adapters[n].dtype)) for n in adapters if n.endswith(A_NAME)
    }
    stages: list[Any] = [None] * len(pp_ranks)
    dist.all_gather_object(stages, mine, group=pp_group)
    table = [m for m in mapping_table(dims, te_names=uses_te_names(params)) if m.megatron.endswith(".weight")]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for m in table:
            stem = m.megatron[: -len(".weight")]
            owners = [s for s, held in enumerate(stages) if stem in held]
            if not owners:
                continue
            owner = owners[0]
            rank, dtype = stages[owner][stem]
            column = stem.rsplit(".", 1)[-1] in COLUMN_LINEARS
            for half, named in _halves(m, rank, dims):
                names = [n for n, _ in named]
                if pp_rank == owner:
                    whole = _gathered(adapters[f"{stem}.{half}"], split_dim(column, half), tp_group, tp)
                    tensors = _relaid(m, half, whole, names, dims, tp)
                else:
                    tensors = [
                        (n, torch.empty(s, dtype=getattr(torch, dtype.removeprefix("torch.")))) for n, s in named
                    ]
                for _, t in tensors if len(pp_ranks) > 1 else ():
                    dist.broadcast(t, src=pp_ranks[owner], group=pp_group)
                yield from tensors

    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in stream():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
