"""Checkpoints of a training run: atomic, verified save and exact resume (store.py), the manifest of sizes and
checksums every checkpoint carries (manifest.py), and `megatron-rlvr ckpt verify` (command.py).

The loop uses this package's API below; everything else is the modules' own.
"""

from megatron_rlvr.checkpoint.store import (
    CheckpointError,
    ShardWriter,
    load,
    load_object,
    resolve,
    save,
    save_adapter,
    save_hf,
    write_shards,
)

__all__ = [
    "CheckpointError",
    "ShardWriter",
    "load",
    "load_object",
    "resolve",
    "save",
    "save_adapter",
    "save_hf",
    "write_shards",
]
