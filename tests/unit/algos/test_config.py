"""AlgoConfig: recipes with out-of-range knobs fail at load time, naming the key and what was expected."""

from __future__ import annotations

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.testing.configs import algo_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.loss.alpha=1.5", "algo.loss.alpha"),
        ("algo.loss.tau_q=1.0", "algo.loss.tau_q"),
        ("algo.loss.top_n=0", "algo.loss.top_n"),
        ("algo.loss.eps_low=1.0", "algo.loss.eps_low"),
        ("algo.loss.kappa=0", "algo.loss.kappa"),
        ("algo.loss.kind=ppo", "algo.loss.kind"),
        ("algo.loss.cov_fraction=2", "algo.loss.cov_fraction"),
        ("algo.loss.weights=argmax", "algo.loss.weights"),
        ("algo.rollout_correction.kind=is", "algo.rollout_correction.kind"),
        ("algo.rollout_correction.level=batch", "algo.rollout_correction.level"),
        ("algo.rollout_correction.cap=0.9", "algo.rollout_correction.cap"),
        ("algo.rollout_correction.low=1.1", "algo.rollout_correction.low"),
        ("algo.rollout_correction.high=0.9", "algo.rollout_correction.high"),
        ("rollout.refill_max_rounds=-1", "rollout.refill_max_rounds"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_good_recipe_loads():
    cfg = load_config(
        overrides=[
            "algo.loss.kind=casp",
            "algo.loss.alpha=0.1",
            "algo.loss.weights=softmax",
            "algo.loss.apply_to=negative",
        ]
    )
    assert cfg.algo == algo_config(
        {"loss.kind": "casp", "loss.alpha": 0.1, "loss.weights": "softmax", "loss.apply_to": "negative"}
    )


def test_off_policy_knobs_load():
    cfg = load_config(
        overrides=[
            "algo.rollout_correction.kind=icepop",
            "algo.rollout_correction.level=sequence",
            "algo.rollout_correction.low=0.8",
            "algo.drop_uniform_groups=true",
            "algo.mask_truncated=true",
            "rollout.refill_max_rounds=0",
        ]
    )
    assert cfg.algo == algo_config(
        {
            "rollout_correction.kind": "icepop",
            "rollout_correction.level": "sequence",
            "rollout_correction.low": 0.8,
            "drop_uniform_groups": True,
            "mask_truncated": True,
        }
    )
    assert cfg.rollout.refill_max_rounds == 0 and algo_config().rollout_correction.kind == "none"
