"""The experience source's construction: what it refuses before it builds anything."""

from __future__ import annotations

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.source import make_source


def test_a_replaced_engine_or_collection_under_separate_placement_is_refused_naming_the_key():
    """The engine ranks build and drive their engines where they run: a replacement would be ignored silently."""
    cfg = load_config(None, ["rollout.placement=separate", "rollout.engine_ranks=1", "actor.tp=1"])

    def engine(cfg, rank):
        raise AssertionError("never built")

    for replaced in ({"make_engine": engine}, {"collect_step": lambda *a, **k: None}):
        with pytest.raises(ConfigError, match=r"rollout\.placement=separate: .*trainer\.Parts engine, collect"):
            make_source(cfg, None, None, None, None, 0, start_step=0, **replaced)
