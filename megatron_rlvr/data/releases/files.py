"""The records of a public release as downloaded: one file or a directory of JSON / JSONL / Parquet files.

Layouts handled: a single file; the original tarballs (MATH's ``train/<subject>/<n>.json``, GSM8K's
``data/train.jsonl``); Hugging Face dataset repositories (``<config>/train-00000-of-00001.parquet``,
``data/train.jsonl``, ``synlogic_easy/train.parquet``). Under a directory, the files of ``split`` are those with a
path part named ``split`` or a name ``split.*`` / ``split-*``; when no file names any split (DAPO-Math-17k's one
``data/dapo-math-17k.parquet``), every file is read. A ``.json`` file holds one record or a list of records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rlvr.data.sources import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")
KNOWN_SPLITS = ("train", "test", "validation", "valid", "val", "dev")


def _split_of(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).parts
    for split in KNOWN_SPLITS:
        name = parts[-1].lower()
        if split in (p.lower() for p in parts[:-1]) or name.startswith((f"{split}.", f"{split}-")):
            return split
    return None


def release_files(src: str | Path, split: str = "train") -> list[Path]:
    """The data files of ``split`` under ``src`` (or ``src`` itself), sorted; DataError naming src if none."""
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise DataError(f"--src {src}: not found; give the release's directory or one of its data files")
    files = sorted(
        p
        for p in src.rglob("*")
        if p.is_file()
        and p.name.lower().endswith(SUFFIXES)
        and not any(part.startswith(".") for part in p.relative_to(src).parts)
    )
    if not files:
        raise DataError(f"--src {src}: holds no {', '.join(SUFFIXES)} files")
    splits = {p: _split_of(p, src) for p in files}
    chosen = [p for p in files if splits[p] == split]
    if chosen:
        return chosen
    if all(s is None for s in splits.values()):
        return files
    found = sorted({s for s in splits.values() if s})
    raise DataError(f"--src {src}: no {split!r} files (found the splits {found}); pick one with --split")


def read_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for every record of one file; where is "<path>:<line>" or "<path>:row <n>"."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: cannot be read as Parquet ({e})") from e
        for i, record in enumerate(table.to_pylist(), 1):
            yield f"{path}:row {i}", record
    elif name.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{line_no}", _object(line, f"{path}:{line_no}")
    else:
        data = _object(path.read_text(encoding="utf-8"), str(path), allow_list=True)
        if isinstance(data, list):
            for i, record in enumerate(data, 1):
                if not isinstance(record, dict):
                    raise DataError(f"{path}: item {i}: expected a JSON object, got {type(record).__name__}")
                yield f"{path}:item {i}", record
        else:
            yield str(path), data


def _object(text: str, where: str, allow_list: bool = False) -> Any:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(data, dict) or (allow_list and isinstance(data, list)):
        return data
    raise DataError(f"{where}: expected a JSON object, got {type(data).__name__}")
