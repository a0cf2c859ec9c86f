"""Section configs built for tests and benchmarks the way the loader builds them from a recipe: from dotted keys,
with every type and declared limit checked (megatron_rlvr/config/loader.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.config import Config, config_of, from_dict


def nested(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``{"loss.kind": "grpo", "kl.coef": 0.1}`` -> ``{"loss": {"kind": "grpo"}, "kl": {"coef": 0.1}}``."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def algo_config(settings: Mapping[str, Any] = {}, /, **more: Any) -> AlgoConfig:  # noqa: B006 (read only)
    """An `AlgoConfig` from keys relative to ``algo`` (``{"loss.kind": "grpo", "kl.coef": 0.1}``, or top-level
    fields as keywords: ``demonstrations=True``), checked as a recipe's ``algo`` section is."""
    return from_dict(AlgoConfig, nested({**settings, **more}), "algo")


def run_config(settings: Mapping[str, Any] = {}, /) -> Config:  # noqa: B006 (read only)
    """The run `Config` of dotted keys (``{"algo.distill.kind": "self"}``), loaded as a recipe is: types, limits and
    the ``load`` rules between fields checked."""
    return config_of(nested(settings))


def replaced(cfg: Any, settings: Mapping[str, Any] = {}, /, **more: Any) -> Any:  # noqa: B006 (read only)
    """``cfg`` (a section's dataclass) with the fields at dotted keys replaced: ``replaced(algo, {"kl.coef": 0.1})``."""
    changes: dict[str, Any] = {}
    for name, value in nested({**settings, **more}).items():
        current = getattr(cfg, name)
        changes[name] = (
            replaced(current, value) if isinstance(value, dict) and dataclasses.is_dataclass(current) else value
        )
    return dataclasses.replace(cfg, **changes)
