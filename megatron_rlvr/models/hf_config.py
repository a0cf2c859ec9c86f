"""Reading an HF ``config.json`` (the one reader: `read_hf_config` as written, `load_hf_config` validated) and
picking its family by the ``architectures`` field.

The family files (``qwen2.py``, ``llama.py``, ``qwen3.py``) hold what differs and refuse anything that would silently change the
math; the checks they share are in ``family.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.models import llama, qwen2, qwen3, qwen3_moe
from megatron_rlvr.models.family import ModelFamily, UnsupportedModelError


class ModelConfigMissing(UserError, FileNotFoundError):
    """No ``config.json`` where a model directory was named; the message names the path and what writes one."""


FAMILIES: dict[str, ModelFamily] = {
    qwen2.ARCHITECTURE: qwen2,
    llama.ARCHITECTURE: llama,
    qwen3.ARCHITECTURE: qwen3,
    qwen3_moe.ARCHITECTURE: qwen3_moe,
}


def config_path(source: str | Path) -> Path:
    """The ``config.json`` of an HF model directory, or the file itself."""
    path = Path(source)
    return path / "config.json" if path.is_dir() else path


def read_hf_config(source: str | Path) -> dict[str, Any]:
    """The JSON of ``config.json`` (a directory or the file) as written, not validated. A missing file raises
    `ModelConfigMissing` (a `FileNotFoundError`), a broken one `UnsupportedModelError`, each naming the file."""
    path = config_path(source)
    if not path.is_file():
        relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ModelConfigMissing(
            f"HF config {path}{relative}: not found (expected an HF model directory or its config.json); download "
            "the model there, or write one with `megatron-rlvr convert mcore-to-hf|gguf-to-hf` (docs/checkpoints.md)"
        )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"HF config {path}: not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise UnsupportedModelError(f"HF config {path}: expected a JSON object, got {type(hf).__name__}")
    return hf


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Read ``config.json`` (a directory, the file itself, or an already-loaded dict) and validate it.

    Returns a plain dict; raises :class:`UnsupportedModelError` naming the file and field for anything unsupported.
    """
    if isinstance(source, Mapping):
        hf, where = dict(source), "<config dict>"
    else:
        hf, where = read_hf_config(source), str(config_path(source))
    family_of(hf, where).validate(hf, where)
    return hf


def family_of(hf: Mapping[str, Any], where: str = "<config dict>") -> ModelFamily:
    """The family module (``qwen2``, ``llama``, ``qwen3``, ...) for this config's ``architectures`` entry."""
    families = FAMILIES
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in families:
        raise UnsupportedModelError(
            f"HF config {where}: architectures={archs!r} is not supported; supported: {sorted(families)}"
        )
    return families[archs[0]]
