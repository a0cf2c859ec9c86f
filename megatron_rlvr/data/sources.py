"""Read prompt rows from local JSONL or Parquet files, each row tagged with where it came from (file and line).

Reading only: no tokenization, no validation of fields (see dataset.py). A line that is not valid JSON, or not a
JSON object, is reported with its file and line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import UserError


class DataError(UserError, ValueError):
    """A dataset file or row is unusable; the message names the file, the line and what was expected."""


@dataclass(frozen=True)
class Row:
    source: str  # "<path>:<line>" (JSONL, 1-based line) or "<path>:row <n>" (Parquet, 1-based row)
    file_name: str
    line: int
    data: dict[str, Any] | None  # None when the line could not be parsed; `error` says why
    error: str = ""


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.txt", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


def read_rows(path: str | Path) -> Iterator[Row]:
    """Rows of a JSONL or Parquet file, in file order. Blank JSONL lines are not rows."""
    path = Path(path)
    if not path.is_file():
        raise missing_dataset(path)
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        yield from _read_parquet(path)
    elif name.endswith(JSONL_SUFFIXES):
        yield from _read_jsonl(path)
    else:
        raise DataError(
            f"dataset file {path}: unknown format; expected one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )


def missing_dataset(path: str | Path, key: str = "") -> DataError:
    """The error for a dataset file that is not there: it names the command that writes one (``key``: the config
    key that named the file, e.g. data.path)."""
    where = f"{key}: " if key else ""
    relative = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
    return DataError(
        f"{where}dataset file {path}{relative}: not found; write it with `megatron-rlvr data prepare NAME ... "
        f"--out {path}` (the recipe's header gives its command; the names: `megatron-rlvr data prepare --help`; "
        "docs/data.md)"
    )


def _read_jsonl(path: Path) -> Iterator[Row]:
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                yield Row(where, path.name, line_no, None, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(data, dict):
                yield Row(where, path.name, line_no, None, f"expected a JSON object, got {type(data).__name__}")
                continue
            yield Row(where, path.name, line_no, data)


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"dataset file {path}: cannot be read as Parquet ({e})") from e
    for i, data in enumerate(table.to_pylist(), start=1):
        yield Row(f"{path}:row {i}", path.name, i, data)
