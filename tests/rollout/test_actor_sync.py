"""Actor -> engine: a Megatron actor at TP=2 or PP=2 streams its weights through the bridge into rank 0's CPU vLLM
engine; the engine's log-probs of fixed sequences equal the actor's own (fp32, <= 1e-4), again after the weights
change (tied-embedding Llama included, where the changed embedding must reach the engine's output layer); also with
lent buckets (``lend=True`` / ``update_weights(lent=True)``), where the engine must copy out what it keeps."""

from __future__ import annotations

import pytest

from tests.rollout.sync_workers import sync_and_compare

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7, 8], [42] * 5 + [7, 300, 600, 999]]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("actor_sync")
    return {arch: str(make_tiny_hf_model(arch, root / arch, seed=11)) for arch in ("qwen2", "llama")}


@pytest.mark.parametrize(
    "arch, tp, pp, lend, staging",
    [
        ("qwen2", 2, 1, False, "full"),
        ("llama", 2, 1, False, "full"),
        ("llama", 1, 2, False, "full"),
        # lent buckets (views of shared memory, reused two buckets later), rank 1 serving only
        ("qwen2", 2, 1, True, "full"),
        ("llama", 2, 1, True, "full"),
        ("qwen2", 2, 1, True, "streaming"),
    ],
)
def test_engine_logprobs_equal_the_actors_after_each_sync(workers2, tiny_dirs, arch, tp, pp, lend, staging):
    args = (tiny_dirs[arch], tp, pp, SEQS, 64 << 10, lend, staging)
    results = workers2.run(sync_and_compare, *args, timeout_s=600)
    engine_side = results[0]["rounds"]
    actor_side = next(r["rounds"] for r in results if r["rounds"][0]["actor"] is not None)
    diffs = [
        max((e - a).abs().max().item() for e, a in zip(eng["engine"], act["actor"]))
        for eng, act in zip(engine_side, actor_side)
    ]
    moved = max((a - b).abs().max().item() for a, b in zip(actor_side[0]["actor"], actor_side[1]["actor"]))
    print(f"{arch} tp={tp} pp={pp}: max |engine - actor| per sync {diffs}; the change moved log-probs {moved:.3g}")
    assert moved > 100 * TOL  # the second sync had something to carry
    assert all(d <= TOL for d in diffs), diffs
