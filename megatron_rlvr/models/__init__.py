"""HF architectures on megatron-core: config mapping, layer spec and model construction (Qwen2, Llama).

Cross-team API::

    from megatron_rlvr.models import load_hf_config, transformer_config_from_hf, build_gpt_model, padded_vocab_size
    hf = load_hf_config(hf_dir_or_config_json)   # dict; unsupported architecture / math-changing field -> error
    tcfg = transformer_config_from_hf(hf, tp=2, pp=1, vpp=None, params_dtype=torch.float32,
                                      sequence_parallel=False, recompute="none", **megatron_overrides)
    model = build_gpt_model(hf, tcfg, pre_process=True, post_process=True, vp_stage=None, use_te=None)
    padded_vocab_size(hf["vocab_size"], tp, divisible_by=128)   # rows of the (sharded) embedding / output layer

A model's forward returns logits sharded over TP along the vocab (``parallel_output=True``): the local shard holds
global ids ``[r * Vp / tp, (r + 1) * Vp / tp)`` with ``Vp = padded_vocab_size(...)``; ids >= ``hf["vocab_size"]``
are padding. ``make_tiny_hf_model`` (``megatron_rlvr.testing.tiny_models``) writes a random HF checkpoint for tests.
"""

from megatron_rlvr.models.builder import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    build_gpt_model,
    layer_spec,
    padded_vocab_size,
    transformer_config_from_hf,
)
from megatron_rlvr.models.family import UnsupportedModelError
from megatron_rlvr.models.hf_config import family_of, load_hf_config

__all__ = [
    "DEFAULT_VOCAB_DIVISIBLE_BY",
    "UnsupportedModelError",
    "build_gpt_model",
    "family_of",
    "layer_spec",
    "load_hf_config",
    "padded_vocab_size",
    "transformer_config_from_hf",
]
