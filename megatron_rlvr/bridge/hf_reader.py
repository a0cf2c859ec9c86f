"""Reading HF safetensors checkpoints (one file, or shards with ``model.safetensors.index.json``) slice by slice.

Only the requested rows/columns are read; at most one file is open (memory-mapped) at a time, so resident memory
stays near the tensors being converted, not the checkpoint. Every failure names the file and tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpointError(ValueError):
    """An HF checkpoint is missing a file or tensor, is truncated, or holds a tensor of the wrong shape."""


class HFCheckpointReader:
    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._open_file: str | None = None
        self._handle = None
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
            raise HFCheckpointError(f"{self.dir}: {len(files)} safetensors files but no {INDEX_NAME} to say which is which")
        return {name: files[0].name for name in self._open(files[0].name).keys()}

    def _open(self, file: str):
        if self._open_file != file:
            self.close()
            from safetensors import safe_open

            path = self.dir / file
            try:
                self._handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
                raise HFCheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from e
            self._open_file = file
        return self._handle

    def close(self) -> None:
        self._handle, self._open_file = None, None

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint")
        return self.dir / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.file_of(name)
        try:
            return tuple(self._open(file.name).get_slice(name).get_shape())
        except HFCheckpointError:
            raise
        except Exception as e:
            raise HFCheckpointError(f"{file}: cannot read tensor {name}: {e}") from e

    def check_shapes(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor present with the expected shape (header reads only), before anything is converted."""
        for name in sorted(expected, key=lambda n: (self.weight_map.get(n, ""), n)):
            got = self.shape(name)
            if got != tuple(expected[name]):
                raise HFCheckpointError(
                    f"{self.file_of(name)}: tensor {name} has shape {list(got)}, expected {list(expected[name])}"
                )

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The tensor, or its ``[start, stop)`` slice along ``dim``; data is checked to be fully present."""
        file = self.file_of(name)
        try:
            if dim is None:
                return self._open(file.name).get_tensor(name)
            sl = self._open(file.name).get_slice(name)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            return sl[index].contiguous()
        except HFCheckpointError:
            raise
        except Exception as e:
            raise HFCheckpointError(f"{file}: cannot read tensor {name}: {e}") from e

    def names(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
