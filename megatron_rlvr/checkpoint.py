"""Atomic save/resume of a training run: actor weights + optimizer (megatron dist checkpoint), data position, RNG
states and trainer counters.

Layout: ``<root>/step-000012/`` (one finished checkpoint each), ``<root>/latest`` (a text file naming the newest).
A checkpoint is written into ``<root>/.tmp-step-000012/`` and renamed only after every rank finished writing, and
``latest`` is replaced atomically after that: a crash or a full disk at any moment leaves the previous checkpoint
and ``latest`` as they were.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _sharded_state_dict(actor) -> dict[str, Any]:
    chunks = actor.model_chunks
    if len(chunks) == 1:
        model_sd: dict[str, Any] = {"model": chunks[0].sharded_state_dict()}
    else:
        model_sd = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    model_sd["optimizer"] = actor.optimizer.sharded_state_dict(model_sd)
    return model_sd


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _agree_ok(ok: bool) -> bool:
    """True only if every rank succeeded (a collective: every rank must call it)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def save(root: str | Path, step: int, actor, trainer_state: dict[str, Any], keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` (a collective over all ranks). Returns its directory."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    tmp, final = root / f".tmp-step-{step:06d}", _step_dir(root, step)
    error: BaseException | None = None
    try:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
    except OSError as e:
        error = e
    if _agree_ok(error is None):
        try:
            dist_checkpointing.save(_sharded_state_dict(actor), str(tmp))
            torch.save(_rng_state(), tmp / "rng" / f"rank-{_rank():05d}.pt")
            if _rank() == 0:
                state = dict(trainer_state, step=step, scheduler=actor.scheduler.state_dict())
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))
        except BaseException as e:  # noqa: BLE001 - any failure must leave the previous checkpoint intact
            error = e
    if not _agree_ok(error is None):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint {final} was not written (previous checkpoints are intact): {error}")
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        for old in sorted(root.glob("step-*"))[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def resolve(root: str | Path, resume: str | None) -> Path | None:
    """The checkpoint directory a ``resume`` setting names: "latest" (None if there is none yet), or a path."""
    if resume is None:
        return None
    root = Path(root)
    if resume == LATEST:
        pointer = root / LATEST
        if not pointer.is_file():
            return None
        path = root / pointer.read_text().strip()
    else:
        path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"checkpoint {path}: not a finished checkpoint (no trainer_state.json)")
    return path


def load(path: str | Path, actor) -> dict[str, Any]:
    """Restore actor weights, optimizer, LR schedule and this rank's RNG from ``path``; return the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    loaded = dist_checkpointing.load(_sharded_state_dict(actor), str(path))
    chunks = actor.model_chunks
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
    actor.optimizer.load_state_dict(loaded["optimizer"])
    actor.scheduler.load_state_dict(state.pop("scheduler"))
    rng_file = path / "rng" / f"rank-{_rank():05d}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"checkpoint {path}: no RNG state for rank {_rank()} (saved with another world size?)")
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return state
