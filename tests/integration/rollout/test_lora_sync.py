"""LoRA weights into a CPU vLLM engine (rank 0) from an actor at TP = 2 through the colocated sync
(experience/colocated.sync_weights): merged weights, and the adapter alone served by vLLM's LoRA under a new name each
sync. After each sync (adapters filled, then one update) the engine's log-probs of fixed sequences equal the actor's
(fp32, <= 1e-4); an adapter stream with a wrong shape is refused after it was drained and the engine keeps serving
the adapter it had, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.engine, pytest.mark.slow]

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7, 8], [42] * 5 + [7, 300, 600, 999]]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_sync"), seed=11))


def _sequences(vocab: int):
    from megatron_rlvr.testing.handoffs import rollouts

    width = max(map(len, SEQS))
    tokens = torch.zeros(len(SEQS), width, dtype=torch.long)
    mask = torch.zeros(len(SEQS), width - 1, dtype=torch.bool)
    for i, seq in enumerate(SEQS):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq) - 1] = True
    return rollouts(tokens, mask)


def _actor_rows(actor, batch) -> list[torch.Tensor]:
    logp = actor.compute_old_logp(batch)
    return [logp[i, : len(seq) - 1] for i, seq in enumerate(SEQS)]


def _sync_rounds(hf_dir: str, sync: str):
    import torch.distributed as dist

    from megatron_rlvr.experience.colocated import sync_weights
    from megatron_rlvr.protocols import Statistics, Targets
    from megatron_rlvr.rollout import RolloutConfig, WeightSyncError, make_engine
    from megatron_rlvr.runtime.distributed import model_parallel
    from tests.integration.actor.lora_workers import build, fill_from_hf_layout

    engine = None
    with model_parallel(tp=2, seed=11):
        actor = build(hf_dir, tp=2, sync=sync, temperature=1.0, micro_batch_size=4)
        try:
            if dist.get_rank() == 0:
                cfg = RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20)
                adapter = actor.lora.spec if sync == "adapters" else None
                engine = make_engine(hf_dir, cfg, adapter=adapter)
            batch = _sequences(actor.vocab_size)
            rounds = []
            for step in range(2):
                if step == 0:
                    fill_from_hf_layout(actor, seed=4)
                else:  # one update moves the adapters
                    b = _sequences(actor.vocab_size)
                    targets = Targets(advantages=torch.tensor([1.0, -1.0, 0.5]))
                    actor.update(b, targets, Statistics(old_logp=actor.compute_old_logp(b)), mini_batches=1)
                if engine is not None:
                    sync_weights(actor, engine, 64 << 10)
                else:
                    for _ in actor.engine_weights(64 << 10, lend=True):  # a collective: join it to the end
                        pass
                engine_rows = [torch.tensor(x) for x in engine.prompt_logprobs(SEQS)] if engine else None
                rounds.append({"actor": _actor_rows(actor, batch), "engine": engine_rows})
            refused = None
            if engine is not None and sync == "adapters":
                good = [(n, t.clone()) for bucket in actor.engine_weights(1 << 30) for n, t in bucket]
                bad = good[:-1] + [(good[-1][0], torch.zeros(3, 3))]
                before = engine.prompt_logprobs(SEQS)
                try:
                    engine.update_weights(iter(bad))
                except WeightSyncError as e:
                    refused = str(e)
                refused = (refused, engine.prompt_logprobs(SEQS) == before)
            elif sync == "adapters":
                for _ in actor.engine_weights(1 << 30):
                    pass
            return {"rounds": rounds, "refused": refused}
        finally:
            if engine is not None:
                engine.close()


@pytest.mark.parametrize("sync", ["merged", "adapters"])
def test_engine_logprobs_equal_the_lora_actors_after_each_sync(workers2, tiny_qwen, sync):
    out = workers2.run(_sync_rounds, tiny_qwen, sync, timeout_s=900)[0]
    diffs = [max((e - a).abs().max().item() for e, a in zip(r["engine"], r["actor"])) for r in out["rounds"]]
    moved = max((a - b).abs().max().item() for a, b in zip(out["rounds"][0]["actor"], out["rounds"][1]["actor"]))
    print(f"sync={sync}: max |engine - actor| per sync {diffs}; the update moved log-probs {moved:.3g}")
    assert moved > 10 * TOL
    assert all(d <= TOL for d in diffs), diffs
    if sync == "adapters":
        message, unchanged = out["refused"]
        assert message is not None and "shape [3, 3]" in message and unchanged
