"""Separate placement: the actor at (TP, PP) = (2, 1) and (1, 2) on ranks 0-1 sends its weights to a TP-1 CPU vLLM
engine on rank 2 (its own ranks, split from one world); after each transfer the engine's log-probs of fixed sequences
equal the actor's within fp32 rounding (megatron_rlvr/testing/rounding.py), also after the weights changed. A Qwen3-MoE actor at EP=2 ships its experts the
same way (each actor rank holds half of them; the export gathers them from their owners)."""

from __future__ import annotations

import pytest

from megatron_rlvr.testing.rounding import model_logprob_bound
from megatron_rlvr.testing.workers import WorkerGroup
from tests.integration.experience.engine_server_workers import separate_sync_and_compare

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7, 8], [42] * 5 + [7, 300, 600, 999]]


@pytest.fixture
def workers3():
    # fresh processes per test: re-splitting a world destroys every process group of the process (torch's
    # destroy_process_group of the default group), vLLM's private ones of an earlier engine included
    with WorkerGroup(3, timeout_s=600) as group:
        yield group


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("engine_rank")
    return {arch: str(make_tiny_hf_model(arch, root / arch, seed=11)) for arch in ("qwen2", "qwen3_moe")}


@pytest.mark.parametrize("arch, tp, pp, ep", [("qwen2", 2, 1, 1), ("qwen2", 1, 2, 1), ("qwen3_moe", 1, 1, 2)])
def test_engine_rank_logprobs_equal_the_actors_after_each_transfer(workers3, tiny_dirs, arch, tp, pp, ep):
    results = workers3.run(separate_sync_and_compare, tiny_dirs[arch], tp, pp, SEQS, 64 << 10, ep, timeout_s=600)
    assert [r["role"] for r in results] == ["actor", "actor", "engine"]
    engine = results[2]["rounds"]
    actor = next(r["rounds"] for r in results[:2] if r["rounds"][0]["logp"] is not None)  # the last stage's
    assert [r["version"] for r in engine] == [0, 1]
    diffs = [
        max((e - a).abs().max().item() for e, a in zip(eng["logp"], act["logp"])) for eng, act in zip(engine, actor)
    ]
    moved = max((a - b).abs().max().item() for a, b in zip(actor[0]["logp"], actor[1]["logp"]))
    sent = results[0]["rounds"][1]["transfer"]
    bound = model_logprob_bound(tiny_dirs[arch], max(map(len, SEQS)), max(r["scale"] for r in actor))
    print(
        f"{arch} tp={tp} pp={pp} ep={ep}: max |engine - actor| per transfer {diffs}; bound {bound:.3g}; the change "
        f"moved log-probs {moved:.3g}; second transfer {sent}"
    )
    assert sent["transfer/bytes"] > 0 and sent["transfer/buckets"] > 1  # 64 KiB buckets: many messages
    assert moved > 100 * bound  # the second transfer had something to carry
    assert all(d <= bound for d in diffs), diffs
