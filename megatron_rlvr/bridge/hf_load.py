"""Loading an HF safetensors checkpoint into this rank's Megatron chunks at any (TP, PP): each rank reads only the
slices its own shards need, one tensor at a time (experts: only the experts of its EP rank, cut over ETP)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_rlvr.bridge.hf_reader import HFCheckpointReader
from megatron_rlvr.bridge.layout import load_shard
from megatron_rlvr.bridge.local_params import BridgeError, local_entries, shard_rank_and_size, tp_rank_and_size
from megatron_rlvr.bridge.mapping import hf_shapes
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.hf_config import load_hf_config


@torch.no_grad()
def load_hf_weights(model_chunks, hf_dir: str | Path) -> None:
    """Fill this rank's parameters from ``hf_dir``; every needed tensor's name and shape is checked first.

    Tied embeddings: the output layer (present on the last stage when PP > 1) is loaded from ``embed_tokens``.
    """
    hf = load_hf_config(hf_dir)
    dims = ModelDims.from_hf(hf)
    tp_rank, tp = tp_rank_and_size()
    entries, problems = local_entries(model_chunks, dims, tp)
    if problems:
        raise BridgeError(f"model does not match {hf_dir}/config.json: " + "; ".join(problems))
    # What to read for each local parameter; a tied output layer reads the embedding.
    todo = []
    for e in entries:
        if e.param is None:
            continue
        m = e.mapping
        if dims.tied and m.megatron == "output_layer.weight":
            m = dataclasses.replace(m, hf=("model.embed_tokens.weight",))
        todo.append((m, e.param))
    with HFCheckpointReader(hf_dir) as reader:
        reader.check_shapes({n: s for m, _ in todo for n, s in zip(m.hf, hf_shapes(m, dims))})
        for m, param in todo:
            rank, size = shard_rank_and_size(m) if m.expert else (tp_rank, tp)
            shard = load_shard(m, reader.read, dims, rank, size, tuple(param.shape))
            param.copy_(shard.to(param.dtype))
