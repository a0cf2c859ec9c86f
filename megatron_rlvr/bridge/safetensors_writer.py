"""Writing HF safetensors checkpoints one tensor at a time: the shard layout and headers are planned from names,
shapes and dtypes first, then each tensor's bytes are appended as it is produced (``safetensors.save_file`` would
need every tensor of a file in memory at once)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_rlvr.bridge.hf_reader import INDEX_NAME, SINGLE_NAME

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_shards(
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Group tensors (in order) into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone)."""
    shards, current, size = [], [], 0
    for name, shape, dtype in specs:
        nbytes = _nbytes(shape, dtype)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, tuple(shape), dtype))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def shard_file_names(n: int) -> list[str]:
    return [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_sharded(
    out_dir: str | Path,
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Write ``tensors`` (yielded in the planned order, names/shapes/dtypes as planned) into the planned files,
    plus ``model.safetensors.index.json`` when there is more than one file."""
    out_dir = Path(out_dir)
    names = shard_file_names(len(shards))
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        header, offset = {}, 0
        for name, shape, dtype in shard:
            nbytes = _nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        total += offset
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        with open(out_dir / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, shape, dtype in shard:
                got_name, t = next(tensors)
                if got_name != name or tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"{out_dir / file_name}: expected tensor {name} {list(shape)} {dtype}, "
                        f"got {got_name} {list(t.shape)} {t.dtype}"
                    )
                if t.numel():
                    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no extra copy
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
