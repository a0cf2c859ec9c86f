"""Loading an HF safetensors checkpoint into this rank's Megatron chunks at any (TP, PP): each rank reads only the
slices its own shards need, one tensor at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from megatron_rlvr.bridge.hf_reader import HFCheckpointReader
from megatron_rlvr.bridge.layout import load_shard
from megatron_rlvr.bridge.local_params import BridgeError, local_entries, tp_rank_and_size
from megatron_rlvr.bridge.mapping import ModelDims, hf_shapes
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
    with HFCheckpointReader(hf_dir) as reader:
        sources = {}
        for e in entries:
            if e.param is None:
                continue
            names = e.mapping.hf
            if dims.tied and e.mapping.megatron == "output_layer.weight":
                names = ("model.embed_tokens.weight",)
            sources[e.mapping.megatron] = names
        reader.check_shapes(
            {n: s for e in entries if e.param is not None
             for n, s in zip(sources[e.mapping.megatron], hf_shapes(e.mapping, dims))}
        )
        for e in entries:
            if e.param is None:
                continue
            m = e.mapping
            if sources[m.megatron] != m.hf:
                m = type(m)(m.megatron, sources[m.megatron], m.kind)
            shard = load_shard(m, reader.read, dims, tp_rank, tp, tuple(e.param.shape))
            e.param.copy_(shard.to(e.param.dtype))
