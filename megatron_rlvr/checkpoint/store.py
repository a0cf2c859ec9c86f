"""Atomic save/resume of a training run: actor weights + optimizer (megatron dist checkpoint), data position, RNG
states and trainer counters.

Layout: ``<root>/step-000012/`` (one finished checkpoint each), ``<root>/latest`` (a text file naming the newest).
A checkpoint is written into ``<root>/.tmp-step-000012/``; after every rank finished writing, the size and CRC-32
of each file go into its ``manifest.json`` (the last file written), the directory is renamed into place, and
``latest`` is replaced atomically after that: a crash or a full disk at any moment leaves the previous checkpoint
and ``latest`` as they were.

Resuming from "latest" checks the newest checkpoint against its manifest and, when a file is missing, truncated
or changed, names it and falls back to the next older checkpoint that checks out (``keep_last`` >= 2 keeps one).
`megatron-rlvr ckpt verify DIR` runs the same check alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlvr.checkpoint.manifest import MANIFEST, Report, verify, write_manifest
from megatron_rlvr.errors import UserError
from megatron_rlvr.protocols.actor import AdapterSource, TrainState, WeightSource
from megatron_rlvr.runtime import callbacks

LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[Path]:
    """The finished checkpoints under ``root``, oldest first (temp dirs of unfinished saves are not among them)."""
    found = [p for p in root.glob("step-*") if step_of(p) is not None and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=step_of)


# Each rank saves its own distributed-optimizer buffers with no gather: resume may change DP, not TP/PP (a
# TP/PP change goes through the model-only dist checkpoint of tools/convert.py).
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


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


def _say(message: str) -> None:
    if _rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _agree_ok(ok: bool) -> bool:
    """True only if every rank succeeded (a collective: every rank must call it)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1])  # a CPU tensor: gloo carries it on GPU machines too (distributed.backend)
    dist.all_reduce(flag)
    return int(flag) == 0


class ShardWriter(Protocol):
    """Writes this rank's shards of a sharded state dict into a checkpoint directory (a collective)."""

    def __call__(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> None: ...


def write_shards(sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> None:
    """megatron-core's distributed save: the `ShardWriter` every checkpoint uses unless the loop is given another."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, checkpoint_dir)


def save(
    root: str | Path,
    step: int,
    actor: TrainState,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
    hf_dir: str | None = None,
    objects: dict[str, Any] | None = None,
    writer: ShardWriter = write_shards,
) -> Path:
    """Write checkpoint ``step`` (a collective over all ranks). Returns its directory. With ``hf_dir``, the HF
    config and tokenizer files are copied into it too, so `convert mcore-to-hf` can export the step directly.
    ``objects`` (rank 0's; None values skipped) are pickled beside the trainer state, one file each, read back with
    `load_object` (e.g. the rollout a one-step-off run sampled ahead with weights the checkpoint does not hold).
    ``writer`` writes the actor's shards; whatever it raises leaves the previous checkpoints intact."""
    from megatron_rlvr.bridge.dist_ckpt import write_hf_side_files

    root = Path(root)
    callbacks.fire("checkpoint.before_save", directory=root, step=step)
    tmp, final = root / f".tmp-step-{step:06d}", _step_dir(root, step)
    error: BaseException | None = None
    try:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)  # empty: megatron warns of an "old incomplete checkpoint" in a non-empty one
    except OSError as e:
        error = e
    if _agree_ok(error is None):
        try:
            writer(actor.sharded_state_dict(_OPTIMIZER_FORMAT), str(tmp))
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(_rng_state(), tmp / "rng" / f"rank-{_rank():05d}.pt")
            if _rank() == 0:
                state = dict(trainer_state, step=step, scheduler=actor.scheduler_state_dict())
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))
                for name, obj in (objects or {}).items():
                    if obj is not None:
                        torch.save(obj, tmp / f"{name}.pt")
                if hf_dir:
                    write_hf_side_files(hf_dir, tmp)
        except BaseException as e:  # noqa: BLE001 - any failure must leave the previous checkpoint intact
            error = e
    if _agree_ok(error is None):
        try:  # the last file, once every rank's files are complete: a checkpoint with a manifest is whole
            write_manifest(tmp)
        except BaseException as e:  # noqa: BLE001
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
        # Newer directories belong to a run that was resumed from an older checkpoint (after a fallback, or by
        # hand): `latest` no longer leads to them, and they never count against the ones just written.
        kept = [d for d in step_dirs(root) if step_of(d) <= step]
        for old in kept[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_candidates(root: Path) -> list[Path]:
    """Where "latest" may resume from, newest first: the checkpoint ``latest`` names, then the older ones."""
    dirs = step_dirs(root)
    pointer = root / LATEST
    if not pointer.is_file():
        if dirs:
            _say(f"[checkpoint] {pointer} is missing; trying the newest checkpoint directories")
        return dirs[::-1]
    named = root / pointer.read_text().strip()
    if step_of(named) is None:
        raise CheckpointError(f"{pointer}: names {named.name!r}, expected a directory named step-NNNNNN")
    older = [d for d in dirs if step_of(d) < step_of(named)]
    return [named, *older[::-1]]


def resolve(root: str | Path, resume: str | None) -> Path | None:
    """The checkpoint directory a ``resume`` setting names: "latest" (None if there is none yet), or a path.

    Each candidate is checked against its manifest first (a collective when torch.distributed is initialized).
    "latest" falls back from a damaged checkpoint to the next older one, saying which file failed and why;
    a named path must check out itself. CheckpointError when nothing usable is left."""
    if resume is None:
        return None
    root = Path(root)
    if resume != LATEST:
        report = verify(resume)
        if not report.ok:
            raise CheckpointError(f"checkpoint.resume={resume}: {report.summary()}")
        _warn_if_unverified(report)
        return Path(resume)
    candidates = latest_candidates(root)
    failed: list[Report] = []
    for i, path in enumerate(candidates):
        report = verify(path)
        if report.ok:
            _warn_if_unverified(report)
            # said always: a requeued cluster job's log must show where its rerun picked up
            _say(f"[checkpoint] resuming from {path}" + (", the newest checkpoint that checks out" if failed else ""))
            return path
        failed.append(report)
        then = "; falling back to the previous checkpoint" if i + 1 < len(candidates) else ""
        _say(f"[checkpoint] {report.summary()}{then}")
    if not failed:
        return None
    raise CheckpointError(
        f"no usable checkpoint in {root} (checkpoint.resume=latest): "
        + " | ".join(r.summary() for r in failed)
        + ". Restore one, or start afresh with checkpoint.resume=null (or --resume none) and another output_dir"
    )


def _warn_if_unverified(report: Report) -> None:
    if not report.verified:
        _say(
            f"[checkpoint] warning: {report.path} has no {MANIFEST} (written before checkpoints recorded "
            "checksums): resuming from it unverified"
        )


def load(path: str | Path, actor: TrainState) -> dict[str, Any]:
    """Restore actor weights, optimizer, LR schedule and this rank's RNG from ``path``; return the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    try:
        loaded = dist_checkpointing.load(actor.sharded_state_dict(_OPTIMIZER_FORMAT, is_loading=True), str(path))
    except (EOFError, OSError, RuntimeError, ValueError) as e:  # e.g. damage a checkpoint without manifest hid
        raise CheckpointError(
            f"checkpoint {path}: could not be loaded ({type(e).__name__}: {e}); "
            f"`megatron-rlvr ckpt verify {path}` checks its files"
        ) from e
    actor.load_sharded_state_dict(loaded)
    actor.load_scheduler_state_dict(state.pop("scheduler"))
    rng_file = path / "rng" / f"rank-{_rank():05d}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"checkpoint {path}: no RNG state for rank {_rank()} (saved with another world size?)")
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def load_object(path: str | Path, name: str) -> Any:
    """The object `save` stored as ``name`` in checkpoint ``path``, or None when it stored none."""
    file = Path(path) / f"{name}.pt"
    if not file.is_file():
        return None
    try:
        return torch.load(file, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file must name itself
        raise CheckpointError(f"checkpoint {path}: {file.name} could not be read ({type(e).__name__}: {e})") from e


def save_hf(
    actor: WeightSource, hf_src_dir: str | Path, out_dir: str | Path, bucket_bytes: int = 1 << 30
) -> Path | None:
    """Write the actor's current weights as an HF checkpoint (a collective; rank 0 writes). Each export bucket
    becomes one safetensors file, so memory stays at one bucket whatever the model size; config and tokenizer
    files are copied from ``hf_src_dir``. Written to a temp dir and renamed: never half a checkpoint."""
    from safetensors.torch import save_file

    from megatron_rlvr.bridge.dist_ckpt import HF_SIDE_FILES

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    files = []
    # an HF checkpoint of a tied model has no lm_head (an engine sync does send it)
    for i, bucket in enumerate(actor.export_weights(bucket_bytes, include_lm_head=False)):
        if _rank() == 0:
            name = f"model-{i + 1:05d}.safetensors"
            save_file({n: t.contiguous() for n, t in bucket}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({n: name for n, _ in bucket})
            files.append(name)
    if _rank() == 0:
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / "model.safetensors")
        else:
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        for name in HF_SIDE_FILES:
            if (Path(hf_src_dir) / name).is_file():
                shutil.copy2(Path(hf_src_dir) / name, tmp / name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir if _rank() == 0 else None


def save_adapter(actor: AdapterSource, out_dir: str | Path, bucket_bytes: int = 1 << 30) -> Path | None:
    """Write the actor's LoRA adapter as a PEFT adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``: bridge/peft.py), which ``peft`` and vLLM load onto the base. A collective; rank 0
    writes, into a temp dir renamed at the end. Returns the directory on rank 0 (None elsewhere, or without LoRA)."""
    from megatron_rlvr.bridge.peft import write_adapter

    config = actor.adapter_config()
    if config is None:
        return None
    tensors = {}
    for bucket in actor.export_adapter(bucket_bytes):
        if _rank() == 0:
            tensors.update(bucket)
    out_dir = Path(out_dir)
    if _rank() == 0:
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter(tmp, tensors, config)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir if _rank() == 0 else None
