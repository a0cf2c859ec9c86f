"""Megatron dist checkpoints (``megatron.core.dist_checkpointing``, torch_dist backend) that reload under any
(TP, PP, VPP) — the layout the actor's checkpoints and ``tools/convert.py`` share.

Layout of a checkpoint directory::

    metadata.json, common.pt, .metadata, __*_*.distcp   megatron dist checkpoint of the model, state dict
                                                        {"model": ...} (or {"model0": ..., "model1": ...} per
                                                        virtual pipeline chunk), megatron's own ShardedTensor keys
    hf/config.json (+ tokenizer files)                  the HF config it came from (``write_hf_side_files``)

One deviation from megatron's default state dict: vocabulary tensors (``embedding.word_embeddings.weight``, and
``output_layer.weight`` when untied) are stored *unpadded*, ``[vocab_size, hidden]``, because the padded row count
depends on the TP size; ``checkpoint_sharded_state_dict`` / ``save_dist_checkpoint`` write that form.
``load_dist_checkpoint`` and ``mcore-to-hf`` read both it and megatron's default (rows padded for the saving TP),
since they only use the first ``vocab_size`` rows.

``save_lazily`` writes such a checkpoint without holding the model: the model is built on the meta device, and each
tensor is produced (read from the HF files, re-laid out) only when the writer reaches it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
HF_SUBDIR = "hf"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def _chunk_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _vocab_sharded_tensor(original, full: torch.Tensor, tp_rank: int):
    """The unpadded, TP-independent form of a vocab ShardedTensor: whole tensor, main replica on TP rank 0."""
    from megatron.core.dist_checkpointing import ShardedTensor

    replica = original.replica_id
    replica = (replica[0], tp_rank, replica[2]) if isinstance(replica, tuple) else (replica, tp_rank, 0)
    return ShardedTensor.from_rank_offsets(original.key, full, replica_id=replica)


def checkpoint_sharded_state_dict(
    model_chunks, hf_vocab_size: int, load_rows: dict[str, int] | None = None
) -> dict[str, Any]:
    """The sharded state dict to save (or, with ``load_rows``, to load into) for these chunks; see the module
    docstring. Saving gathers the vocab shards over TP (one vocab tensor per rank, transiently); loading allocates
    the whole stored vocab tensor (``load_rows[key]`` rows), which ``load_dist_checkpoint`` slices into this
    rank's padded shard."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge.local_params import as_chunks

    chunks = as_chunks(model_chunks)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out: dict[str, Any] = {}
    for key, chunk in zip(_chunk_keys(len(chunks)), chunks):
        sd = chunk.sharded_state_dict()
        for name, sh in list(sd.items()):
            if name not in VOCAB_KEYS:
                continue
            local = sh.data
            if load_rows is not None:
                full = torch.empty(load_rows[sh.key], local.shape[1], dtype=local.dtype)
            elif local.is_meta:
                full = torch.empty(hf_vocab_size, local.shape[1], dtype=local.dtype, device=local.device)
            elif tp == 1:
                full = local.detach()[:hf_vocab_size]
            else:
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
                full = torch.cat(parts)[:hf_vocab_size]
            sd[name] = _vocab_sharded_tensor(sh, full, tp_rank)
        out[key] = sd
    return out


def save_dist_checkpoint(model_chunks, hf_vocab_size: int, ckpt_dir: str | Path) -> None:
    """Collective over all ranks: write the model weights as a dist checkpoint into ``ckpt_dir`` (must exist)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(checkpoint_sharded_state_dict(model_chunks, hf_vocab_size), str(ckpt_dir))


@torch.no_grad()
def load_dist_checkpoint(model_chunks, hf_vocab_size: int, ckpt_dir: str | Path) -> None:
    """Collective: fill the chunks from a dist checkpoint written at any (TP, PP, VPP)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge.local_params import as_chunks

    chunks = as_chunks(model_chunks)
    stored = DistCheckpointReader(ckpt_dir)
    load_rows = {}
    for key in VOCAB_KEYS:
        if key in stored.keys():  # noqa: SIM118 - a checkpoint index, not a dict
            load_rows[key] = stored.shape(key)[0]
            if load_rows[key] < hf_vocab_size:
                raise ValueError(
                    f"dist checkpoint {ckpt_dir}: {key} has {load_rows[key]} rows, fewer than vocab_size={hf_vocab_size}"
                )
    request = checkpoint_sharded_state_dict(chunks, hf_vocab_size, load_rows=load_rows)
    loaded = dist_checkpointing.load(request, str(ckpt_dir))
    tp_rank = ps.get_tensor_model_parallel_rank()
    for key, chunk in zip(_chunk_keys(len(chunks)), chunks):
        state = loaded[key]
        own = chunk.state_dict(keep_vars=True)
        for name in VOCAB_KEYS:
            if name in state and name in own and own[name] is not None:
                rows = own[name].shape[0]
                start, stop = tp_rank * rows, min((tp_rank + 1) * rows, hf_vocab_size)
                shard = torch.zeros_like(own[name])
                if stop > start:
                    shard[: stop - start] = state[name][start:stop]
                state[name] = shard
        chunk.load_state_dict(state, strict=False)
        missing = {k for k in own if not k.endswith("_extra_state")} - set(state)
        if missing:
            raise KeyError(f"dist checkpoint {ckpt_dir}: no data for {sorted(missing)}")


def write_hf_side_files(hf_dir: str | Path, ckpt_dir: str | Path) -> None:
    """Copy config.json and tokenizer files beside a dist checkpoint, so mcore-to-hf can rebuild an HF dir."""
    dest = Path(ckpt_dir) / HF_SUBDIR
    dest.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        src = Path(hf_dir) / name
        if src.is_file():
            shutil.copy2(src, dest / name)


# ---------------------------------------------------------------------------------------------------------------
# Lazy save: one tensor in memory at a time


def save_lazily(
    sharded_state_dict: dict[str, Any],
    ckpt_dir: str | Path,
    produce: Callable[[str, int, int], torch.Tensor],
    on_tensor: Callable[[str], None] | None = None,
) -> None:
    """``dist_checkpointing.save`` of a state dict whose tensors live on the meta device: ``produce(name, part,
    n_parts)`` returns the real data of state-dict entry ``name`` (or of piece ``part`` of the ``n_parts`` a
    factory split it into, e.g. fc1's gate and up) when the writer reaches it. Single process; memory stays near
    one tensor."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(
        sharded_state_dict, str(ckpt_dir), sharded_strategy=_LazyTorchDistStrategy(produce, on_tensor)
    )


def _lazy_strategy_base():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy


class _LazyTorchDistStrategy(_lazy_strategy_base()):
    """The torch_dist save strategy (same backend and version in metadata.json, so any megatron loads it), but
    writing through torch DCP's serial writer with a planner that produces each tensor on demand."""

    def __init__(self, produce, on_tensor) -> None:
        super().__init__("torch_dist", 1, thread_count=1)
        self.produce, self.on_tensor = produce, on_tensor

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        # (sharded key, global offset) -> (state-dict name, part): factories were applied, so fc1 is a list.
        producers: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
        for chunk in sharded_state_dict.values():
            for name, value in chunk.items():
                parts = value if isinstance(value, list) else [value]
                for i, sh in enumerate(parts):
                    if isinstance(sh, ShardedTensor):
                        producers[(sh.key, tuple(sh.global_offset))] = (name, i, len(parts))
        produce, on_tensor = self.produce, self.on_tensor

        class LazyPlanner(MCoreSavePlanner):
            def resolve_data(self, write_item):
                if write_item.tensor_data is None:
                    return super().resolve_data(write_item)
                index = write_item.index
                name, part, n_parts = producers[(index.fqn, tuple(index.offset))]
                data = produce(name, part, n_parts).reshape(tuple(write_item.tensor_data.chunk.sizes))
                if on_tensor is not None and part == n_parts - 1:  # one tick per state-dict entry
                    on_tensor(name)
                return data

        sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1)
        dcp_save(
            pyt_state_dict,
            storage_writer=writer,
            planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


# ---------------------------------------------------------------------------------------------------------------
# Region reads: one layer of one tensor at a time, whatever TP/PP wrote the checkpoint


class DistCheckpointReader:
    """Reads rectangular regions of a dist checkpoint's tensors straight from its torch DCP files (metadata read
    once), so a converter holds one layer's tensor, not a stacked ``[layers, ...]`` one or the model."""

    def __init__(self, ckpt_dir: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = Path(ckpt_dir)
        self._reader = FileSystemReader(str(self.dir))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def keys(self) -> list[str]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        out = torch.empty(sizes, dtype=self.dtype(key))
        items = create_read_items_for_chunk_list(
            key, self.metadata.state_dict_metadata[key], [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
        )

        class Region(LoadPlanner):
            def set_up_planner(self, *a, **k):
                pass

            def create_local_plan(self):
                return LoadPlan(items)

            def create_global_plan(self, plans):
                return plans

            def finish_plan(self, plan):
                return plan

            def load_bytes(self, read_item, value):
                raise AssertionError("tensor reads only")

            def resolve_tensor(self, read_item):
                view = out
                for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                    view = view.narrow(dim, start, length)
                return view

            def commit_tensor(self, read_item, tensor):
                pass

        plan = self._reader.prepare_local_plan(LoadPlan(items))
        (plan,) = self._reader.prepare_global_plan([plan])
        self._reader.read_data(plan, Region()).wait()
        return out
