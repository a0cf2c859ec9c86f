"""AlgoConfig: recipes with out-of-range knobs fail at load time, naming the key and what was expected."""

from __future__ import annotations

import pytest

from megatron_rlvr.algos import AlgoConfig
from megatron_rlvr.config import load_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.alpha=1.5", "algo.alpha"),
        ("algo.tau_q=1.0", "algo.tau_q"),
        ("algo.top_n=0", "algo.top_n"),
        ("algo.eps_low=1.0", "algo.eps_low"),
        ("algo.kappa=0", "algo.kappa"),
        ("algo.loss=ppo", "algo.loss"),
        ("algo.cov_fraction=2", "algo.cov_fraction"),
        ("algo.weights=argmax", "algo.weights"),
        ("algo.rollout_correction=is", "algo.rollout_correction"),
        ("algo.rollout_correction_level=batch", "algo.rollout_correction_level"),
        ("algo.rollout_is_cap=0.9", "algo.rollout_is_cap"),
        ("algo.rollout_is_low=1.1", "algo.rollout_is_low"),
        ("algo.rollout_is_high=0.9", "algo.rollout_is_high"),
        ("rollout.refill_max_rounds=-1", "rollout.refill_max_rounds"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_good_recipe_loads():
    cfg = load_config(overrides=["algo.loss=casp", "algo.alpha=0.1", "algo.weights=softmax", "algo.apply_to=negative"])
    assert cfg.algo == AlgoConfig(loss="casp", alpha=0.1, weights="softmax", apply_to="negative")


def test_off_policy_knobs_load():
    cfg = load_config(
        overrides=[
            "algo.rollout_correction=icepop",
            "algo.rollout_correction_level=sequence",
            "algo.rollout_is_low=0.8",
            "algo.drop_uniform_groups=true",
            "algo.mask_truncated=true",
            "rollout.refill_max_rounds=0",
        ]
    )
    assert cfg.algo == AlgoConfig(
        rollout_correction="icepop",
        rollout_correction_level="sequence",
        rollout_is_low=0.8,
        drop_uniform_groups=True,
        mask_truncated=True,
    )
    assert cfg.rollout.refill_max_rounds == 0 and AlgoConfig().rollout_correction == "none"
