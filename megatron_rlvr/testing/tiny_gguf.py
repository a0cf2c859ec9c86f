"""Tiny GGUF files written from tiny HF checkpoints the way llama.cpp's ``convert_hf_to_gguf.py`` writes them, for
tests of ``convert gguf-to-hf`` (nothing downloaded).

``write_tiny_gguf(hf_dir, path, ggml_type)``: the HF checkpoint (``tiny_models.make_tiny_hf_model``) as a GGUF file
of its family (``llama``, ``qwen2``, ``qwen3``): llama.cpp's metadata keys and tensor names (the ``gguf`` package's
own table), Llama's q/k rows permuted for llama.cpp's rope, 2-D weights stored as ``ggml_type`` (F32, F16, Q8_0,
Q4_1, ...; 1-D norms and biases stay F32, as llama.cpp keeps them), and a byte-level ``gpt2`` tokenizer with a
ChatML template. ``write_gguf_header_only`` writes a file of given metadata and raw tensors, for refusal tests.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.bridge.hf_reader import HFCheckpointReader

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_gguf(hf_dir: str | Path, path: str | Path, ggml_type: str = "F32", drop: Collection[str] = ()) -> Path:
    """``drop``: GGUF tensor names to leave out (a broken file for refusal tests)."""
    import gguf

    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = ARCHS[hf["architectures"][0]]
    qtype = gguf.GGMLQuantizationType[ggml_type]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)}
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if hf.get("head_dim"):  # llama.cpp states it whenever the HF config does
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, hf["vocab_size"], hf.get("bos_token_id"), hf.get("eos_token_id"))

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 1000)
    with HFCheckpointReader(hf_dir) as reader:
        for hf_name in reader.names():
            base, suffix = hf_name.rsplit(".", 1)
            data = reader.read(hf_name).float().numpy()
            if arch == "llama" and base.endswith("q_proj"):
                data = _permute(data, heads)
            elif arch == "llama" and base.endswith("k_proj"):
                data = _permute(data, kv_heads)
            gguf_name = f"{names.get_name(base)}.{suffix}"
            if gguf_name not in drop:
                _add(writer, gguf_name, data, qtype if data.ndim == 2 else None)
    _finish(writer)
    return Path(path)


def write_gguf_header_only(
    path: str | Path, arch: str, fields: Mapping[str, Any], tensors: Mapping[str, tuple[np.ndarray, str]]
) -> Path:
    """A GGUF file with ``general.architecture = arch``, string/int ``fields`` and ``{name: (raw array, ggml
    type name)}`` tensors stored as given (a uint8 array of whole blocks for a block type)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, (raw, type_name) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    _finish(writer)
    return Path(path)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rope pairs moved from halves to interleaved rows."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _add(writer, name: str, data: np.ndarray, qtype) -> None:
    import gguf

    if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    else:
        writer.add_tensor(name, gguf.quantize(data, qtype), raw_dtype=qtype)


def _add_tokenizer(writer, vocab_size: int, bos: int | None, eos: int | None) -> None:
    """256 byte tokens (GPT-2's byte alphabet), then special tokens, padded to the model's vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    unused = [f"<|unused_{i}|>" for i in range(vocab_size - 256 - len(special) - 1)]
    tokens = byte_tokens + special + ["\u0120t"] + unused  # " t": the one merge (the writer drops an empty list)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * len(special) + [1] + [3] * len(unused))  # 1: normal, 3: control
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(257 if bos is None else bos)
    writer.add_eos_token_id(258 if eos is None else eos)
    writer.add_pad_token_id(258 if eos is None else eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
