"""Actor -> engine: a Megatron actor at TP=2 or PP=2 streams its weights through the bridge into rank 0's CPU vLLM
engine; the engine's log-probs of fixed sequences equal the actor's own within fp32 rounding
(megatron_rlvr/testing/rounding.py: two implementations, about 6e-5 for these models), again after the weights
change (tied-embedding Llama included, where the changed embedding must reach the engine's output layer); also with
lent buckets (``lend=True`` / ``update_weights(lent=True)``), where the engine must copy out what it keeps."""

from __future__ import annotations

import pytest

from megatron_rlvr.testing.rounding import model_logprob_bound
from tests.integration.rollout.sync_workers import sync_and_compare

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7, 8], [42] * 5 + [7, 300, 600, 999]]
LONGEST = max(map(len, SEQS))


def _bound(model_dir: str, rounds: list[dict]) -> float:
    """The fp32 bound of an engine-vs-actor comparison of SEQS, at the largest logit the actor saw in ``rounds``."""
    return model_logprob_bound(model_dir, LONGEST, max(r["scale"] for r in rounds))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("actor_sync")
    return {arch: str(make_tiny_hf_model(arch, root / arch, seed=11)) for arch in ("qwen2", "llama", "qwen3_moe")}


@pytest.mark.parametrize(
    "arch, tp, pp, lend, staging, ep",
    [
        ("qwen2", 2, 1, False, "full", 1),
        ("llama", 2, 1, False, "full", 1),
        ("llama", 1, 2, False, "full", 1),
        # lent buckets (views of shared memory, reused two buckets later), rank 1 serving only
        ("qwen2", 2, 1, True, "full", 1),
        ("llama", 2, 1, True, "full", 1),
        ("qwen2", 2, 1, True, "streaming", 1),
        # Qwen3-MoE (mixed dense/MoE layers) from an actor at EP=2 (experts from their EP owners), and TP=2 x EP=2
        ("qwen3_moe", 1, 1, False, "full", 2),
        ("qwen3_moe", 2, 1, True, "full", 2),
    ],
)
def test_engine_logprobs_equal_the_actors_after_each_sync(workers2, tiny_dirs, arch, tp, pp, lend, staging, ep):
    args = (tiny_dirs[arch], tp, pp, SEQS, 64 << 10, lend, staging, ep, 1 if ep > 1 else None)
    results = workers2.run(sync_and_compare, *args, timeout_s=600)
    engine_side = results[0]["rounds"]
    actor_side = next(r["rounds"] for r in results if r["rounds"][0]["actor"] is not None)
    diffs = [
        max((e - a).abs().max().item() for e, a in zip(eng["engine"], act["actor"]))
        for eng, act in zip(engine_side, actor_side)
    ]
    moved = max((a - b).abs().max().item() for a, b in zip(actor_side[0]["actor"], actor_side[1]["actor"]))
    bound = _bound(tiny_dirs[arch], actor_side)
    print(
        f"{arch} tp={tp} pp={pp}: max |engine - actor| per sync {diffs}; bound {bound:.3g}; "
        f"the change moved log-probs {moved:.3g}"
    )
    assert moved > 100 * bound  # the second sync had something to carry
    assert all(d <= bound for d in diffs), diffs


def test_an_engine_that_adopts_lent_tensors_keeps_the_full_staging_guarantee(workers2, tiny_dirs):
    """The CPU engine computes on the export's lent slot instead of copying it (docs/weight-sync.md): a bad stream and
    later exports must still leave it bit for bit as it was, and the export must never write the slot it holds."""
    from tests.integration.rollout.sync_workers import adopted_syncs_keep_the_guarantee

    results = workers2.run(adopted_syncs_keep_the_guarantee, tiny_dirs["qwen2"], SEQS, 64 << 10, timeout_s=600)
    r0 = results[0]
    print({k: v for k, v in r0.items() if k not in ("engine", "actor")})
    assert r0["first"] == "ok" and r0["holding_after_first"] in ([0], [1])
    assert r0["bad"].startswith("refused") and "shape" in r0["bad"]
    assert r0["bit_identical_after_bad"] and r0["bit_identical_after_export"] and r0["alive"]
    assert not any(r["lent_with_both_held"] for r in results)
    assert r0["good"] == "ok" and r0["holding_after_good"] == [1 - r0["holding_after_first"][0]]
    actor = next(r for r in results if r["actor"] is not None)
    gap = max((e - a).abs().max().item() for e, a in zip(r0["engine"], actor["actor"]))
    assert gap <= _bound(tiny_dirs["qwen2"], [actor]), gap
