"""Tensor re-layout between Megatron and HF for each mapping kind: HF slices -> one Megatron TP shard (load),
a gathered Megatron tensor -> HF tensors (export), and one Megatron shard -> the matching HF row/column slices
(the same-TP hand-over, no gather).

``tp_rank`` / ``tp`` name the group that shards the tensor: TP, or ETP for an expert's weight
(``local_params.shard_rank_and_size``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rlvr.bridge.mapping import ParamMapping
from megatron_rlvr.models.dims import ModelDims

# read(hf_name, dim, start, stop) -> the HF tensor's [start, stop) slice along dim (dim None: the whole tensor)
SliceReader = Callable[[str, "int | None", int, int], torch.Tensor]


def _qkv_rows(dims: ModelDims) -> tuple[int, int]:
    """(rows of q, rows of k (= v)) per query group."""
    return dims.heads_per_group * dims.head_dim, dims.head_dim


def load_shard(
    m: ParamMapping, read: SliceReader, dims: ModelDims, tp_rank: int, tp: int, local_shape: tuple[int, ...]
) -> torch.Tensor:
    """Megatron TP shard ``tp_rank`` of ``m`` built from only the HF slices it needs."""
    if m.kind == "replicated":
        return read(m.hf[0], None, 0, 0)
    if m.kind in ("column", "row"):
        n = local_shape[m.tp_dim]
        return read(m.hf[0], m.tp_dim, tp_rank * n, (tp_rank + 1) * n)
    if m.kind == "vocab":
        rows = local_shape[0]
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, dims.vocab)
        out = torch.zeros(local_shape, dtype=torch.float32)
        if stop > start:
            part = read(m.hf[0], 0, start, stop)
            out = out.to(part.dtype)
            out[: stop - start] = part
        return out
    if m.kind == "gate_up":
        n = local_shape[0] // 2
        gate = read(m.hf[0], 0, tp_rank * n, (tp_rank + 1) * n)
        up = read(m.hf[1], 0, tp_rank * n, (tp_rank + 1) * n)
        return torch.cat([gate, up], dim=0)
    if m.kind == "qkv":
        q_rows, kv_rows = _qkv_rows(dims)
        g = dims.kv_heads // tp
        g0 = tp_rank * g
        q = read(m.hf[0], 0, g0 * q_rows, (g0 + g) * q_rows)
        k = read(m.hf[1], 0, g0 * kv_rows, (g0 + g) * kv_rows)
        v = read(m.hf[2], 0, g0 * kv_rows, (g0 + g) * kv_rows)
        tail = q.shape[1:]
        out = torch.cat([q.reshape(g, q_rows, *tail), k.reshape(g, kv_rows, *tail), v.reshape(g, kv_rows, *tail)], 1)
        return out.reshape(-1, *tail)
    raise KeyError(f"unknown mapping kind {m.kind!r} for {m.megatron}")


def to_hf(m: ParamMapping, full: torch.Tensor, dims: ModelDims, tp: int) -> list[tuple[str, torch.Tensor]]:
    """HF tensors from the gathered Megatron tensor (TP shards concatenated along ``m.tp_dim``)."""
    if m.kind in ("replicated", "column", "row"):
        return [(m.hf[0], full)]
    if m.kind == "vocab":
        return [(m.hf[0], full[: dims.vocab])]
    if m.kind == "gate_up":
        # Concatenated shards are [gate_0; up_0; gate_1; up_1; ...] (ffn: the dense MLP's or one expert's).
        ffn = full.shape[0] // 2
        shards = full.reshape(tp, 2, ffn // tp, *full.shape[1:])
        return [
            (m.hf[0], shards[:, 0].reshape(ffn, *full.shape[1:])),
            (m.hf[1], shards[:, 1].reshape(ffn, *full.shape[1:])),
        ]
    if m.kind == "qkv":
        return list(zip(m.hf, _split_qkv(full, dims)))
    raise KeyError(f"unknown mapping kind {m.kind!r} for {m.megatron}")


def _split_qkv(interleaved: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
    """Per-group interleaved ``[q_g; k_g; v_g]*`` (any number of whole groups) -> q, k, v."""
    q_rows, kv_rows = _qkv_rows(dims)
    tail = interleaved.shape[1:]
    grouped = interleaved.reshape(-1, q_rows + 2 * kv_rows, *tail)
    q, k, v = torch.split(grouped, [q_rows, kv_rows, kv_rows], dim=1)
    return [t.reshape(-1, *tail) for t in (q, k, v)]


def shard_to_hf(
    m: ParamMapping, shard: torch.Tensor, dims: ModelDims, tp_rank: int, tp: int
) -> list[tuple[str, torch.Tensor, int | None, int, int]]:
    """HF-named pieces of one Megatron TP shard: ``(hf_name, tensor, dim, start, stop)`` where the tensor is the
    HF tensor's ``[start, stop)`` slice along ``dim`` (``dim`` None: the whole, replicated tensor)."""
    if m.kind == "replicated":
        return [(m.hf[0], shard, None, 0, shard.shape[0])]
    if m.kind in ("column", "row"):
        n = shard.shape[m.tp_dim]
        return [(m.hf[0], shard, m.tp_dim, tp_rank * n, (tp_rank + 1) * n)]
    if m.kind == "vocab":
        rows = shard.shape[0]
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, dims.vocab)
        return [(m.hf[0], shard[: max(stop - start, 0)], 0, start, max(stop, start))]
    if m.kind == "gate_up":
        n = shard.shape[0] // 2
        gate, up = shard[:n], shard[n:]
        return [(m.hf[0], gate, 0, tp_rank * n, (tp_rank + 1) * n), (m.hf[1], up, 0, tp_rank * n, (tp_rank + 1) * n)]
    if m.kind == "qkv":
        q_rows, kv_rows = _qkv_rows(dims)
        g = dims.kv_heads // tp
        q, k, v = _split_qkv(shard, dims)
        return [
            (m.hf[0], q, 0, tp_rank * g * q_rows, (tp_rank + 1) * g * q_rows),
            (m.hf[1], k, 0, tp_rank * g * kv_rows, (tp_rank + 1) * g * kv_rows),
            (m.hf[2], v, 0, tp_rank * g * kv_rows, (tp_rank + 1) * g * kv_rows),
        ]
    raise KeyError(f"unknown mapping kind {m.kind!r} for {m.megatron}")
