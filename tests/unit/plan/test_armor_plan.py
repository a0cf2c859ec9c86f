"""The plan counts ARMOR's reference: algo.armor.anchors (or the mixed ratio alone) holds a frozen copy of the
policy's weights in every phase, and nothing more (the anchors come from the rollout engine itself)."""

from __future__ import annotations

import json

import pytest

from megatron_rlvr.plan import command

RECIPE = "qwen2.5-7b_synlogic_casp"  # actor TP=2, bf16, no KL term


def _plan(capsys, *overrides: str) -> dict:
    command.main([RECIPE, *overrides, "--json"])
    return json.loads(capsys.readouterr().out)


def test_armor_adds_one_reference_copy_to_every_phase(capsys):
    alone = _plan(capsys)
    assert alone["components"]["reference_gb"] == 0.0
    armor = _plan(capsys, "algo.armor.anchors=true")
    reference = armor["components"]["reference_gb"]
    assert reference == armor["components"]["actor_weights_gb"] > 0
    for phase in ("rollout", "update", "sync"):
        assert armor["phases"][phase] == pytest.approx(alone["phases"][phase] + reference, abs=0.02), phase
    mixed_only = _plan(capsys, "algo.armor.mixed_ratio_share=0.5")
    assert mixed_only["components"]["reference_gb"] == reference
