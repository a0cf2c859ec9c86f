"""Reading HF safetensors checkpoints (one file, or shards with ``model.safetensors.index.json``) slice by slice.

The safetensors header is parsed here and data is read with plain file reads of exactly the bytes needed (no
memory map: a mapped file's touched pages count as resident memory until it is closed, which would make a
converter's footprint grow with the file). A dim-0 slice is one contiguous read; other slices read the whole
tensor. Every failure names the file and tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_rlvr.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HFCheckpointError(UserError, ValueError):
    """An HF checkpoint is missing a file or tensor, is truncated, or holds a tensor of the wrong shape."""


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header entries by tensor name, byte offset of the data section); checks the file holds all the data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file (header of {header_len} B, file {size} B)")
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, entry in header.items():
        if entry.get("dtype") not in DTYPES:
            raise HFCheckpointError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
        end = entry["data_offsets"][1]
        if data_start + end > size:
            raise HFCheckpointError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {data_start + end}, file has {size}"
            )
    return header, data_start


class HFCheckpointReader:
    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index (need a 'weight_map'): {e}") from e
            for file in sorted(set(weight_map.values())):
                if not (self.dir / file).is_file():
                    names = [n for n, f in weight_map.items() if f == file]
                    raise HFCheckpointError(
                        f"{self.dir / file}: shard file listed in {INDEX_NAME} is missing "
                        f"(holds {len(names)} tensors, e.g. {names[0]})"
                    )
            return dict(weight_map)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise HFCheckpointError(f"{self.dir}: no {INDEX_NAME} and no *.safetensors file")
        if len(files) > 1:
            raise HFCheckpointError(
                f"{self.dir}: {len(files)} safetensors files but no {INDEX_NAME} to say which is which"
            )
        return dict.fromkeys(self._header(files[0].name)[0], files[0].name)

    def _header(self, file: str) -> tuple[dict[str, Any], int]:
        if file not in self._headers:
            self._headers[file] = read_header(self.dir / file)
        return self._headers[file]

    def _entry(self, name: str) -> tuple[Path, dict[str, Any], int]:
        file = self.file_of(name)
        header, data_start = self._header(file.name)
        if name not in header:
            raise HFCheckpointError(f"{file}: tensor {name} (listed in {INDEX_NAME}) is not in the file")
        return file, header[name], data_start

    def close(self) -> None:
        self._headers.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint")
        return self.dir / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entry(name)[1]["dtype"]]

    def check_shapes(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor present with the expected shape (header reads only), before anything is converted."""
        for name in sorted(expected, key=lambda n: (self.weight_map.get(n, ""), n)):
            got = self.shape(name)
            if got != tuple(expected[name]):
                raise HFCheckpointError(
                    f"{self.file_of(name)}: tensor {name} has shape {list(got)}, expected {list(expected[name])}"
                )

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The tensor, or its ``[start, stop)`` slice along ``dim``."""
        file, entry, data_start = self._entry(name)
        shape, dtype = list(entry["shape"]), DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if dim not in (None, 0):
            if not 0 <= start <= stop <= shape[dim]:
                raise HFCheckpointError(f"{file}: tensor {name}: slice [{start}, {stop}) of dim {dim} out of {shape}")
            return self.read(name).narrow(dim, start, stop - start).contiguous()
        if dim == 0:
            if not 0 <= start <= stop <= shape[0]:
                raise HFCheckpointError(f"{file}: tensor {name}: rows [{start}, {stop}) out of {shape}")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
            shape[0] = stop - start
        out = torch.empty(shape, dtype=dtype)
        buf = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
        if buf is not None:
            if buf.nbytes != end - begin:
                raise HFCheckpointError(f"{file}: tensor {name}: {end - begin} B of data for shape {shape} {dtype}")
            with open(file, "rb") as f:
                f.seek(data_start + begin)
                if f.readinto(buf) != buf.nbytes:
                    raise HFCheckpointError(f"{file}: truncated while reading tensor {name}")
        return out

    def names(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
