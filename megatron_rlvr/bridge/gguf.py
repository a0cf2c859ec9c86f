"""GGUF checkpoints (llama.cpp's one-file format) read as HF checkpoints: ``convert gguf-to-hf``.

``GGUFCheckpoint(path)`` reads a file's metadata and checks everything before any tensor data is read:

- the architecture: ``general.architecture`` ``llama``, ``qwen2`` or ``qwen3`` (``ARCHITECTURES``), as llama.cpp
  writes them and as transformers' GGUF loader reads them (a ``llama`` file that transformers reads as Mistral is
  refused);
- every tensor's type: one the ``gguf`` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the K- and
  IQ-quants);
- no rope scaling: a ``rope_freqs`` tensor (llama.cpp's llama3 scaling) or a ``rope.scaling.type`` other than
  ``none`` would change positions, and transformers' GGUF loader drops both silently;
- the tensors: exactly those of ``mapping.mapping_table`` for the config, each of the shape ``mapping.hf_shapes``
  gives.

The config is transformers' own reading of the metadata (``AutoConfig``, ``gguf_file=``), written without a
``quantization_config``, with ``architectures``, with ``head_dim`` from ``attention.key_length`` where the file
states it (transformers' qwen3 reading drops it) and with the float32 metadata values (``rms_norm_eps``,
``rope_theta``) as the shortest decimal that float32 holds (``1e-05``, not ``9.999999747378752e-06``). The
tokenizer is transformers' too (``AutoTokenizer``, ``gguf_file=``): ``tokenizer.json`` and
``tokenizer_config.json`` with the special tokens and the chat template; ``generation_config.json`` has the eos.

Tensors are read one at a time with plain file reads (no memory map, as in ``hf_reader``), dequantized by
``gguf.dequantize`` to float32 (the function transformers' loader calls), Llama's q/k rows un-permuted as
transformers does (llama.cpp interleaves them for its rope), then cast to the dtype asked for: in float32 every
tensor equals what ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` holds, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rlvr.bridge.mapping import hf_shapes, mapping_table
from megatron_rlvr.errors import UserError
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.family import UnsupportedModelError
from megatron_rlvr.models.hf_config import load_hf_config

# general.architecture -> the HF architecture it converts to
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_FREQS = "rope_freqs.weight"


class GGUFError(UserError, ValueError):
    """A GGUF file that cannot be converted; the message names the file and what is not supported."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: where its bytes are, how they are stored, and the HF tensor it becomes."""

    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]
    ggml_type: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int
    stored_shape: tuple[int, ...]  # the numpy array the bytes form (rows of blocks for a quantized type)
    stored_dtype: np.dtype
    unpermute_heads: int  # Llama's q/k: the head count llama.cpp permuted the rows with; 0: none


class GGUFCheckpoint:
    """A GGUF file's metadata, checked, with the HF config, tokenizer and tensor plan it converts to."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct/mmap errors on foreign files
            raise GGUFError(f"{self.path}: not a readable GGUF file, or a truncated one ({_one_line(e)})") from e
        if reader.byte_order != "I":
            raise GGUFError(f"{self.path}: a GGUF file of the other byte order is not supported")
        self.arch = _field(reader, "general.architecture")
        if self.arch is None or self.arch not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        by_name = {t.name: t for t in reader.tensors}
        self._check_types(reader.tensors)
        self._check_rope(reader, by_name)
        self.hf_config = self._config(reader)
        dims = ModelDims.from_hf(self.hf_config)
        self.tensors = self._plan(gguf, by_name, dims)
        self.tokenizer = self._tokenizer()

    # -- checks and plan (metadata only) ------------------------------------------------------------------------

    def _check_types(self, tensors) -> None:
        for t in tensors:
            if not _can_dequantize(t.tensor_type):
                raise GGUFError(
                    f"{self.path}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf package "
                    f"cannot dequantize"
                )

    def _check_rope(self, reader, by_name) -> None:
        scaling = _field(reader, f"{self.arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} ({self.arch}.rope.scaling.type) is not supported")
        if _ROPE_FREQS in by_name:
            raise GGUFError(
                f"{self.path}: tensor {_ROPE_FREQS} (llama.cpp's llama3 rope scaling) is not supported: "
                f"transformers' GGUF loader ignores it, so the positions would differ"
            )

    def _config(self, reader) -> dict[str, Any]:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as e:
            raise GGUFError(f"{self.path}: transformers cannot read its config ({_one_line(e)})") from e
        if config.model_type != self.arch:
            raise GGUFError(
                f"{self.path}: transformers reads this {self.arch!r} file as {config.model_type!r}, which is not "
                f"supported; supported: {sorted(ARCHITECTURES)}"
            )
        hf = json.loads(config.to_json_string())  # what save_pretrained writes
        for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version"):
            hf.pop(key, None)
        hf["architectures"] = [ARCHITECTURES[self.arch]]
        key_length = _field(reader, f"{self.arch}.attention.key_length", None)
        if key_length is not None:
            hf["head_dim"] = int(key_length)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = _field(reader, f"{self.arch}.rope.dimension_count", None)
        if rotary is not None and int(rotary) != head_dim:
            raise GGUFError(
                f"{self.path}: {self.arch}.rope.dimension_count={rotary} rotates part of each head "
                f"(head_dim {head_dim}); partial rotary embeddings are not supported"
            )
        hf["rms_norm_eps"] = _float32_decimal(hf["rms_norm_eps"])
        for rope in (hf.get("rope_parameters"), hf):
            if isinstance(rope, dict) and "rope_theta" in rope:
                rope["rope_theta"] = _float32_decimal(rope["rope_theta"])
        try:
            load_hf_config(hf)  # the project's models accept it
        except UnsupportedModelError as e:
            raise GGUFError(f"{self.path}: its config is not supported: {e}") from e
        return hf

    def _plan(self, gguf, by_name, dims: ModelDims) -> list[GGUFTensor]:
        names = gguf.get_tensor_name_map(_model_arch(gguf, self.arch), dims.layers)
        plan = []
        for m in mapping_table(dims):
            if m.megatron == "output_layer.weight" and dims.tied:
                continue
            for hf_name, shape in zip(m.hf, hf_shapes(m, dims)):
                base, suffix = hf_name.rsplit(".", 1)
                gguf_name = f"{names.get_name(base)}.{suffix}"
                t = by_name.pop(gguf_name, None)
                if t is None:
                    raise GGUFError(f"{self.path}: tensor {gguf_name} (HF {hf_name}) is missing")
                stored = tuple(int(d) for d in reversed(t.shape.tolist()))
                if stored != tuple(shape):
                    raise GGUFError(
                        f"{self.path}: tensor {gguf_name} has shape {list(stored)}, expected {list(shape)} "
                        f"for {hf_name} by the file's metadata"
                    )
                heads = 0
                if self.arch == "llama" and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
                    heads = dims.heads if base.endswith("q_proj") else dims.kv_heads
                plan.append(
                    GGUFTensor(
                        gguf_name,
                        hf_name,
                        tuple(shape),
                        t.tensor_type,
                        int(t.data_offset),
                        int(t.n_bytes),
                        tuple(t.data.shape),  # a view's shape: no tensor data is read
                        t.data.dtype,
                        heads,
                    )
                )
        if by_name:
            extra = sorted(by_name)
            raise GGUFError(
                f"{self.path}: {len(extra)} tensor(s) with no place in a {ARCHITECTURES[self.arch]} of this config, "
                f"e.g. {extra[0]}"
            )
        return plan

    def _tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as e:
            raise GGUFError(f"{self.path}: transformers cannot build its tokenizer ({_one_line(e)})") from e

    # -- conversion ---------------------------------------------------------------------------------------------

    def tensor_specs(self, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, shape, dtype) of every tensor ``hf_tensors`` yields, in that order."""
        return [(t.hf_name, t.hf_shape, dtype) for t in self.tensors]

    def hf_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor, dequantized to float32 and cast to ``dtype``, one at a time in file reads."""
        import gguf

        with open(self.path, "rb") as f:
            for t in self.tensors:
                raw = np.empty(t.stored_shape, dtype=t.stored_dtype)
                f.seek(t.offset)
                if raw.nbytes != t.nbytes or f.readinto(memoryview(raw).cast("B")) != t.nbytes:
                    raise GGUFError(f"{self.path}: truncated while reading tensor {t.gguf_name}")
                weights = gguf.dequantize(raw, t.ggml_type)
                if t.unpermute_heads:
                    weights = _unpermute_rows(weights, t.unpermute_heads)
                yield t.hf_name, torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)

    def write_side_files(self, out_dir: str | Path, dtype: torch.dtype) -> None:
        """config.json (with ``dtype``), generation_config.json and the tokenizer files into ``out_dir``."""
        from transformers import GenerationConfig

        out = Path(out_dir)
        config = dict(self.hf_config, dtype=str(dtype).replace("torch.", ""))
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        ids = {k: self.hf_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(out)
        # the chat template goes into tokenizer_config.json, where every reader of HF checkpoints looks for it
        self.tokenizer.save_pretrained(out, save_jinja_files=False)


def _unpermute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Llama's q/k rows (transformers' ``LlamaTensorProcessor``, the same ops)."""
    dim = weights.shape[0] // heads // 2
    w = weights.reshape(heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _can_dequantize(ggml_type) -> bool:
    import gguf

    if ggml_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    _, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    try:
        gguf.dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def _model_arch(gguf, arch: str):
    return next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _float32_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores config floats as float32)."""
    return float(str(np.float32(value)))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
