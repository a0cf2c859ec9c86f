"""Per-sample eval records on disk: sharded JSONL written as it goes, so a killed run resumes losing nothing.

Layout of one model's run directory::

    run.json                 the settings the samples were drawn with (a resumed run must match them)
    samples/shard-00000.jsonl one line per sample: benchmark, problem_id, sample, chunk, reward, finish_reason,
    samples/shard-00001.jsonl num_tokens, text; each process opening the store starts a new shard
    samples/shard-00002-r1.jsonl  written by the engine replica whose first rank is 1 (several engines, torchrun)
    .lock                    held (flock) by rank 0 while a run writes, so two runs never share a directory

A chunk's lines go out in one ``write`` followed by ``fsync``. A kill can only leave the last line of a shard
unterminated: loading ignores such a line (and a resumed run writes to a fresh shard, never after it). Records are
keyed by (benchmark, problem id, sample index); the first copy of a key wins, so nothing is counted twice.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.runtime import callbacks

Key = tuple[str, str, int]
SHARD_MAX_BYTES = 256 * 1024 * 1024


class RunSettingsMismatch(UserError, ValueError):
    """The directory holds samples drawn with other settings; mixing them would corrupt the estimate."""


class RunDirBusy(UserError, RuntimeError):
    """Another eval run holds the directory's lock."""


class CorruptRecord(UserError, ValueError):
    """A samples file holds a line that is not a sample record (edited or damaged)."""


class _Shards:
    """Appends records to fresh shard files of one samples directory: one ``write`` + ``fsync`` per call."""

    def __init__(self, samples_dir: Path, suffix: str = ""):
        self.samples_dir, self.suffix = samples_dir, suffix
        self._file = None
        self._bytes = 0

    def _open_new(self) -> None:
        if self._file is not None:
            self._file.close()
        existing = [int(p.stem.split("-")[1]) for p in self.samples_dir.glob("shard-*.jsonl")]
        index = max(existing, default=-1) + 1
        path = self.samples_dir / f"shard-{index:05d}{self.suffix}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._file = os.fdopen(fd, "wb")
        self._bytes = 0

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        if self._file is None or self._bytes + len(payload) > SHARD_MAX_BYTES:
            self._open_new()
        self._file.write(payload)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._bytes += len(payload)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SampleStore:
    def __init__(self, run_dir: str | Path, settings: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.samples_dir = self.run_dir / "samples"
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.run_dir / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RunDirBusy(f"{self.run_dir}: another eval run is writing here (its .lock is held)") from None
        try:
            self._check_settings(settings)
            self.records: dict[Key, dict] = load_records(self.run_dir)
        except BaseException:
            self._unlock()
            raise
        self._shards = _Shards(self.samples_dir)

    def _check_settings(self, settings: dict[str, Any]) -> None:
        path = self.run_dir / "run.json"
        if path.exists():
            stored = json.loads(path.read_text())
            diffs = [f"{k}: stored {stored.get(k)!r}, now {v!r}" for k, v in settings.items() if stored.get(k) != v]
            if diffs:
                raise RunSettingsMismatch(
                    f"{self.run_dir}: holds samples drawn with other settings ({'; '.join(diffs)}); "
                    "use another --out directory or the same settings"
                )
        else:
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(settings, indent=1, sort_keys=True))
            os.replace(tmp, path)

    def has(self, key: Key) -> bool:
        return key in self.records

    def append(self, records: Iterable[dict]) -> None:
        """Write records (one request) durably; keys already stored are skipped."""
        records = list(records)
        callbacks.fire("eval.before_store", records=records)
        fresh = []
        for record in records:
            key = (record["benchmark"], record["problem_id"], record["sample"])
            if key not in self.records:
                fresh.append(record)
                self.records[key] = record
        self._shards.write(fresh)

    def _unlock(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def close(self) -> None:
        self._shards.close()
        self._unlock()

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class ShardWriter:
    """The store of an engine replica other than rank 0's: appends to shards of its own (``-r<rank>``) in the run
    directory rank 0 holds locked and has checked; it reads nothing (rank 0's plan says what is missing)."""

    def __init__(self, run_dir: str | Path, rank: int):
        samples_dir = Path(run_dir) / "samples"
        samples_dir.mkdir(parents=True, exist_ok=True)
        self._shards = _Shards(samples_dir, suffix=f"-r{rank}")

    def append(self, records: Iterable[dict]) -> None:
        records = list(records)
        callbacks.fire("eval.before_store", records=records)
        self._shards.write(records)

    def close(self) -> None:
        self._shards.close()


def _read_shard(path: Path) -> list[dict]:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # an unterminated last line is a write cut off by a kill
    records = []
    for line_no, line in enumerate(complete.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            _ = (record["benchmark"], record["problem_id"], int(record["sample"]), float(record["reward"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"{path}:{line_no}: not a sample record ({exc}); the file was edited or corrupted"
            ) from None
        records.append(record)
    return records


def load_records(run_dir: str | Path) -> dict[Key, dict]:
    """Every stored record of a run directory (read-only: no lock, no new shard)."""
    records: dict[Key, dict] = {}
    for shard in sorted((Path(run_dir) / "samples").glob("shard-*.jsonl")):
        for record in _read_shard(shard):
            records.setdefault((record["benchmark"], record["problem_id"], record["sample"]), record)
    return records
