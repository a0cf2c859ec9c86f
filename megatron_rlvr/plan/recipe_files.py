"""Where a recipe and its model's config.json are found: by name in the repo's configs/, or by path.

A recipe's `model.hf_dir` names the checkpoint as the job sees it (on a cluster, `/models/<Name>` inside the
container). Its config.json comes from that directory when it is readable here, else from
`configs/models/<Name>/config.json`, the architecture copy kept in the repo, so a recipe can be planned and validated
on a login node or a laptop without the weights. `launch/recipes.py` re-exports these for the launchers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
MODEL_CONFIGS_DIR = CONFIGS_DIR / "models"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def find_recipe(name_or_path: str) -> Path:
    """A recipe by name (`qwen2.5-32b_math-l3to5_casp`) or by path; raises ConfigError listing the known names."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    raise ConfigError(f"recipe {name_or_path!r}: not found; known recipes: {', '.join(recipe_names())}")


def documented_nodes(recipe: Path) -> int | None:
    """The node count of the launch command in a recipe's header (`--executor slurm_h200 --nodes N`), if any."""
    match = re.search(r"--executor slurm_h200 --nodes (\d+)", recipe.read_text())
    return int(match.group(1)) if match else None


def hf_config_path(hf_dir: str) -> Path | None:
    """The config.json describing `hf_dir`'s architecture, or None when neither copy exists."""
    if not hf_dir:
        return None
    direct = Path(hf_dir)
    if not direct.is_absolute():
        direct = REPO_ROOT / direct
    if (direct / "config.json").is_file():
        return direct / "config.json"
    kept = MODEL_CONFIGS_DIR / Path(hf_dir).name / "config.json"
    return kept if kept.is_file() else None


def find_hf_config(hf_dir: str) -> dict[str, Any] | None:
    """The JSON of `hf_config_path`'s file (not validated: the plan names its own keys), or None when there is none."""
    from megatron_rlvr.models.family import UnsupportedModelError
    from megatron_rlvr.models.hf_config import read_hf_config

    path = hf_config_path(hf_dir)
    if path is None:
        return None
    try:
        return read_hf_config(path)
    except UnsupportedModelError as e:
        raise ConfigError(f"model.hf_dir={hf_dir!r}: {e}") from e
