"""ARMOR's anchor rollout (experience/methods/armor.py) with the scripted engine and verifier of test_collect: the
reset and the draw of a whole interval at its first step, one correct reference sample per group placed last, the
paper's prompt filter (counted), anchors positive only, the interval read back on resume, and the one-line errors."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptLoader
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.collect import collect
from megatron_rlvr.experience.methods.armor import AnchorRollout
from megatron_rlvr.experience.transforms import source_config
from megatron_rlvr.rollout import RolloutConfig
from megatron_rlvr.testing.configs import algo_config, run_config
from tests.unit.experience.test_collect import FAILED, MIXED, SOLVED, ScriptedEngine, ScriptedPool, prompt_items

G = 4
KINDS = [MIXED, SOLVED, FAILED, MIXED] * 3


def _cfg(**algo) -> Config:
    return Config(
        algo=algo_config({"armor.anchors": True, "armor.reset_every": 2, **algo}),
        rollout=RolloutConfig(group_size=G, max_new_tokens=5),
    )


def _run(cfg, loader, anchors, step, engine):
    anchors.prepare(step)
    exp = collect(engine, ScriptedPool(), loader, source_config(cfg), pad_id=0, run_seed=cfg.trainer.seed, step=step)
    return anchors.attach(step, exp)


def test_anchors_join_each_group_and_the_filter_drops_the_rest(tmp_path):
    cfg = _cfg()
    assert cfg.algo.mixed_ratio_share(G) == (G - 1) / G  # ARMOR's a: the on-policy share
    loader, engine, resets = PromptLoader(prompt_items(KINDS), 4, seed=0, shuffle=False), ScriptedEngine(), []
    anchors = AnchorRollout(cfg, engine, ScriptedPool(), loader, lambda: resets.append(1), tmp_path, pad_id=0)
    exp = _run(cfg, loader, anchors, 0, engine)
    assert resets == [1] and (tmp_path / "reset_0.pt").is_file()
    # the interval's draw: one chunk of anchor_candidates samples per step of the interval, then the step's G - 1
    assert [n for n, _ in engine.calls] == [4, 4, 4]
    batch = exp.rollouts
    assert batch.tokens.shape[0] == 4 * G
    kinds = [item.prompt_ids[0] for item in exp.items]
    assert kinds == [MIXED, SOLVED, FAILED, MIXED]
    trained = batch.response_mask.view(4, G, -1).any(-1)
    # MIXED: varied policy rewards and a correct anchor; SOLVED: uniform policy rewards; FAILED: no correct anchor
    assert trained.tolist() == [[True] * G, [False] * G, [False] * G, [True] * G]
    anchor = exp.completions[0][-1]
    assert anchor.text == "yes" and exp.rollouts.rewards.view(4, G)[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert float(exp.targets.advantages.view(4, G)[0, -1]) > 0  # the anchor is a positive sample
    m = exp.metrics
    assert (m["anchor/groups_trained"], m["anchor/dropped_no_anchor"], m["anchor/dropped_uniform"]) == (2, 1, 1)
    assert m["anchor/found_frac"] == 0.75
    # reference pass rate over the interval's candidates: per step MIXED 2/4, SOLVED 4/4, FAILED 0/4, MIXED 2/4
    assert m["anchor/reference_pass_rate"] == pytest.approx(0.5)

    # step 1 uses the same interval: no reset, no draw; a resumed run reads the interval back from the file
    _run(cfg, loader, anchors, 1, engine)
    assert resets == [1] and len(engine.calls) == 4
    resumed_loader = PromptLoader(prompt_items(KINDS), 4, seed=0, shuffle=False)
    resumed_loader.next_batch()
    resumed = AnchorRollout(cfg, engine, ScriptedPool(), resumed_loader, lambda: resets.append(1), tmp_path, pad_id=0)
    again = _run(cfg, resumed_loader, resumed, 1, engine)
    assert resets == [1] and len(engine.calls) == 5  # the step's own rollout only
    assert torch.equal(again.rollouts.response_mask, _run(cfg, loader_at(1), anchors, 1, engine).rollouts.response_mask)


def loader_at(step: int) -> PromptLoader:
    loader = PromptLoader(prompt_items(KINDS), 4, seed=0, shuffle=False)
    for _ in range(step):
        loader.next_batch()
    return loader


def test_a_resume_without_the_interval_file_is_one_line(tmp_path):
    cfg = _cfg()
    loader = loader_at(1)
    anchors = AnchorRollout(cfg, ScriptedEngine(), ScriptedPool(), loader, lambda: None, tmp_path, pad_id=0)
    with pytest.raises(ConfigError, match=r"^algo.armor.anchors: resuming at step 1, but .*reset_0.pt .* is missing"):
        anchors.prepare(1)


def test_armor_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match=r"^algo.kl.coef: expected 0.0 under ARMOR"):
        run_config({"algo.armor.anchors": True, "algo.kl.coef": 0.1})
    with pytest.raises(ValueError, match=r"^algo.armor.candidates: expected >= 1"):
        algo_config({"armor.candidates": 0})
    with pytest.raises(ConfigError, match=r"^algo.armor.anchors: rollout.group_size=1 leaves no policy sample"):
        run_config({"algo.armor.anchors": True, "rollout.group_size": 1})
    cfg = Config(algo=algo_config({"armor.anchors": True, "drop_uniform_groups": True}))
    with pytest.raises(ConfigError, match=r"^algo.armor.anchors: ARMOR's prompt filter already drops"):
        cfg.validate()
