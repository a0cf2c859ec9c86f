"""Tiny random HF checkpoints made locally with transformers (nothing downloaded), for tests and demos.

``make_tiny_hf_model("qwen2" | "llama" | "qwen3", out_dir, **config_overrides)`` writes config.json, safetensors (sharded
when ``max_shard_size`` is given) and a byte-level tokenizer. Every parameter is random, biases and norm weights
included, so a mapping bug in any tensor shows up in the logits. Head size defaults to 32, which vLLM-CPU supports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads over 2 groups), qkv bias, untied, and a vocab that no TP size > 1 divides.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=1001,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Tied embeddings and llama3 rope scaling with Llama-3.2's constants.
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    ),
    # Per-head q/k norms, no biases, and head_dim=64 != hidden/heads=32 (q_proj has 256 rows for 128 hidden).
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=1001,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # 8 experts, top-2, a dense layer among the MoE ones (mlp_only_layers), renormalized top-k (override
    # norm_topk_prob=False for the other routing).
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=1001,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}

CONFIG_CLASSES = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}

EOS_TOKEN = "<|endoftext|>"


def make_tiny_hf_config(arch: str, **overrides: Any):
    import transformers

    if arch not in TINY_DEFAULTS:
        raise ValueError(f"make_tiny_hf_model: arch={arch!r}; expected one of {sorted(TINY_DEFAULTS)}")
    values = {**TINY_DEFAULTS[arch], **overrides}
    cls = getattr(transformers, CONFIG_CLASSES[arch])
    values.setdefault("bos_token_id", 256)
    values.setdefault("eos_token_id", 256)
    return cls(**values)


@torch.no_grad()
def make_tiny_hf_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random HF checkpoint of family ``arch`` to ``out_dir`` and return the directory."""
    from transformers import AutoModelForCausalLM

    cfg = make_tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        elif name.endswith("mlp.gate.weight"):  # a router with clear preferences: no near-ties in the top-k
            param.copy_(0.5 * torch.randn_like(param))
        else:
            param.copy_(0.05 * torch.randn_like(param))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    if with_tokenizer:
        byte_level_tokenizer().save_pretrained(out)
    return out


def byte_level_tokenizer():
    """A byte-level tokenizer (256 byte tokens + EOS at id 256): encodes any text, small enough for any tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOS_TOKEN] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=EOS_TOKEN)


@torch.no_grad()
def write_random_hf_checkpoint(
    arch: str,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int = 2 * 10**9,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A random HF checkpoint of any size written one tensor at a time (never the whole model in memory), for
    benchmarks and memory tests of conversion and weight sync. Loads with ``AutoModelForCausalLM``."""
    from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table
    from megatron_rlvr.bridge.safetensors_writer import plan_shards, write_sharded
    from megatron_rlvr.models.dims import ModelDims

    cfg = make_tiny_hf_config(arch, **overrides)
    cfg.dtype = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    hf = cfg.to_dict()
    hf["architectures"] = list(cfg.architectures)
    dims = ModelDims.from_hf(hf)
    specs = [
        (name, tuple(shape), dtype)
        for m in mapping_table(dims)
        if not (m.megatron == "output_layer.weight" and dims.tied)
        for name, shape in zip(m.hf, hf_shapes(m, dims))
    ]
    gen = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape, _ in specs:
            t = torch.randn(shape, generator=gen, dtype=dtype).mul_(0.1 if name.endswith("norm.weight") else 0.02)
            yield name, (t.add_(1.0) if name.endswith("norm.weight") else t)

    write_sharded(out, plan_shards(specs, max_shard_size), tensors())
    return out
