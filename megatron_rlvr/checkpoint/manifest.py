"""A checkpoint's manifest: the size and CRC-32 of every file in it, and the check of a checkpoint against it.

``save`` calls `write_manifest` after every rank finished writing and before the directory is renamed into place,
so the manifest is the last file of a checkpoint and covers every rank's files. `verify` re-reads the files and
names the first damage of each kind it finds (missing file, wrong size, wrong checksum). Both are collectives when
torch.distributed is initialized (the files are split over the ranks, each rank hashing its share) and plain
functions otherwise (`megatron-rlvr ckpt verify`).

CRC-32 (zlib, in the standard library) detects truncation and flipped bits, which is what a checksum here is for
(not tampering); it was the fastest of the standard library's choices on this machine.
A checkpoint written before manifests existed has none: it is accepted with a warning, unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"
ALGORITHM = "crc32"
_CHUNK = 8 << 20
_THREADS = 4  # zlib and hashlib release the GIL on large buffers: a few files are read and hashed at once


@dataclass(frozen=True)
class Problem:
    """One reason a checkpoint cannot be trusted: the file (relative to the checkpoint) and what is wrong."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


@dataclass(frozen=True)
class Report:
    """The outcome of checking one checkpoint: no problems = good; ``verified`` False = it had no manifest."""

    path: Path
    problems: tuple[Problem, ...]
    verified: bool
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.problems:
            shown = "; ".join(str(p) for p in self.problems[:5])
            more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
            return f"DAMAGED {self.path}: {shown}{more}"
        if not self.verified:
            return f"UNVERIFIED {self.path}: no {MANIFEST} (written before checkpoints recorded checksums)"
        rate = self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"OK {self.path}: {self.files} files, {self.bytes / 1e6:.1f} MB checked in {self.seconds:.2f} s "
            f"({rate:.0f} MB/s)"
        )


def file_checksum(path: Path, algorithm: str = ALGORITHM) -> str:
    """The checksum of a file, streamed in chunks (never the whole file in memory)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        if algorithm == "crc32":
            crc = 0
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
            return f"{crc:08x}"
        digest = hashlib.new(algorithm)
        while n := f.readinto(buf):
            digest.update(view[:n])
        return digest.hexdigest()


def _files(ckpt_dir: Path) -> dict[str, int]:
    """Every regular file under ``ckpt_dir`` but the manifest, by relative path, with its size."""
    out = {}
    for path in ckpt_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            rel = path.relative_to(ckpt_dir).as_posix()
            if rel != MANIFEST:
                out[rel] = path.stat().st_size
    return out


# ----------------------------------------------------------------------------------------------------------------
# collectives (plain functions without torch.distributed)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _share(sizes: dict[str, int], seen_by: dict[str, list[int]], world: int) -> dict[str, int]:
    """Which rank hashes which file: largest first, each to the least loaded rank that can see it."""
    load, owner = [0] * world, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(seen_by[name], key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


def _map_files(fn: Callable[[str], Any], names: Iterable[str]) -> dict[str, Any]:
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(names)))) as pool:
        return dict(zip(names, pool.map(fn, names)))


def write_manifest(ckpt_dir: str | Path) -> Path | None:
    """Record the size and checksum of every file in ``ckpt_dir`` (a collective: call it on every rank after every
    rank finished writing). Every rank lists the directory (a file another node wrote may not be visible yet on a
    network filesystem: the union counts) and hashes its share; rank 0 writes the manifest. Raises OSError on every
    rank when any rank failed."""
    ckpt_dir = Path(ckpt_dir)
    rank, world = _world()
    try:
        listing: dict[str, int] | str = _files(ckpt_dir)
    except OSError as e:
        listing = f"rank {rank} could not list {ckpt_dir}: {e}"
    listings = _all_gather(listing)
    failed = [x for x in listings if isinstance(x, str)]
    if failed:
        raise OSError("; ".join(failed))
    sizes: dict[str, int] = {}
    seen_by: dict[str, list[int]] = {}
    for r, files in enumerate(listings):
        for name, size in files.items():
            sizes[name] = size
            seen_by.setdefault(name, []).append(r)
    owner = _share(sizes, seen_by, world)
    mine = [n for n, r in owner.items() if r == rank]
    try:
        sums: dict[str, str] | str = _map_files(lambda n: file_checksum(ckpt_dir / n), mine)
    except OSError as e:
        sums = f"rank {rank}: {e}"
    gathered = _all_gather(sums)
    failed = [x for x in gathered if isinstance(x, str)]
    if failed:
        raise OSError("checksums of " + str(ckpt_dir) + " failed: " + "; ".join(failed))
    if rank != 0:
        return None
    checksums = {k: v for part in gathered for k, v in part.items()}
    manifest = {
        "format": 1,
        "algorithm": ALGORITHM,
        "files": {n: {"size": sizes[n], ALGORITHM: checksums[n]} for n in sorted(sizes)},
    }
    tmp = ckpt_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, ckpt_dir / MANIFEST)
    return ckpt_dir / MANIFEST


def _check_size(ckpt_dir: Path, name: str, entry: dict[str, Any], algorithm: str) -> Problem | None:
    try:
        size = (ckpt_dir / name).stat().st_size
    except FileNotFoundError:
        return Problem(name, "missing")
    except OSError as e:
        return Problem(name, f"unreadable ({e})")
    if size != entry["size"]:
        hint = " (truncated)" if size < entry["size"] else ""
        return Problem(name, f"size {size} bytes, the manifest says {entry['size']}{hint}")
    return None


def _check_sum(ckpt_dir: Path, name: str, entry: dict[str, Any], algorithm: str) -> Problem | None:
    try:
        got = file_checksum(ckpt_dir / name, algorithm)
    except OSError as e:
        return Problem(name, f"unreadable ({e})")
    if got != entry[algorithm]:
        return Problem(name, f"{algorithm} {got}, the manifest says {entry[algorithm]} (content changed)")
    return None


def _read_manifest(ckpt_dir: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The manifest (None without a usable one) and the problems found before looking at any listed file."""
    if not ckpt_dir.is_dir():
        return None, [Problem(".", "the checkpoint directory is missing")]
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        if not (ckpt_dir / "trainer_state.json").is_file():
            return None, [Problem("trainer_state.json", "missing: not a finished checkpoint")]
        return None, []
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest["algorithm"] != "crc32":
            hashlib.new(manifest["algorithm"])
        for entry in manifest["files"].values():
            int(entry["size"]), entry[manifest["algorithm"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, [Problem(MANIFEST, f"unreadable ({type(e).__name__}: {e})")]
    return manifest, []


def _from_rank0(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def verify(ckpt_dir: str | Path) -> Report:
    """Check ``ckpt_dir`` against its manifest (a collective when torch.distributed is initialized: rank 0 reads
    the manifest, every rank checks a share of the files, and every rank gets the same report)."""
    ckpt_dir = Path(ckpt_dir)
    start = time.perf_counter()
    rank, world = _world()
    manifest, header = _from_rank0(_read_manifest(ckpt_dir) if rank == 0 else None)
    if manifest is None:
        return Report(ckpt_dir, tuple(header), verified=False, seconds=time.perf_counter() - start)
    algorithm, entries = manifest["algorithm"], manifest["files"]
    names = sorted(entries)
    sizes = {n: int(entries[n]["size"]) for n in names}
    owner = _share(sizes, {n: list(range(world)) for n in names}, world)
    mine = [n for n in names if owner[n] == rank]
    problems: dict[str, Problem] = {}
    for check in (_check_size, _check_sum):  # sizes first: a missing or truncated file needs no hashing
        found = _map_files(lambda n, check=check: check(ckpt_dir, n, entries[n], algorithm), mine)
        problems = {n: p for part in _all_gather({n: p for n, p in found.items() if p}) for n, p in part.items()}
        if problems:
            break
    return Report(
        ckpt_dir,
        tuple(problems[n] for n in names if n in problems),
        verified=True,
        files=len(names),
        bytes=sum(sizes.values()),
        seconds=time.perf_counter() - start,
    )
