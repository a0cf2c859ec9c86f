"""AlgoConfig: recipes with out-of-range knobs fail at load time, naming the key and what was expected."""

from __future__ import annotations

import pytest

from megatron_rlvr.algos import AlgoConfig
from megatron_rlvr.config import load_config


@pytest.mark.parametrize(
    "override, key",
    [("algo.alpha=1.5", "algo.alpha"), ("algo.tau_q=1.0", "algo.tau_q"), ("algo.top_n=0", "algo.top_n"),
     ("algo.eps_low=1.0", "algo.eps_low"), ("algo.kappa=0", "algo.kappa"), ("algo.loss=ppo", "algo.loss"),
     ("algo.cov_fraction=2", "algo.cov_fraction"), ("algo.weights=argmax", "algo.weights")],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_good_recipe_loads():
    cfg = load_config(overrides=["algo.loss=casp", "algo.alpha=0.1", "algo.weights=softmax", "algo.apply_to=negative"])
    assert cfg.algo == AlgoConfig(loss="casp", alpha=0.1, weights="softmax", apply_to="negative")
