"""Training a Qwen3-MoE with the Megatron actor: at EP=2 on 2 gloo processes (each holding half the experts) the
statistics pass, the update's loss and gradient norm, and the log-probs after the update equal EP=1 (DP=2, every
expert on both ranks), packed, fp32, relative <= 1e-5; without the KL term, and with it and the frozen reference
(a second update, once the policy has left the reference)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.testing.configs import algo_config

pytestmark = pytest.mark.dist

REL = 1e-5


def _batch(vocab: int, seed: int = 0):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    b, s = 4, 10
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.tensor([10, 7, 9, 5])
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 2 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask)


def _actor_numbers(hf_dir: str, ep: int, kl_coef: float):
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.protocols import Statistics, Targets
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=1, pp=1, seed=11, ep=ep, etp=1):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(ep=ep, etp=1, micro_batch_size=2, lr=1e-3, pack_sequences=True),
            algo_config({"loss.kind": "casp", "loss.tau_q": 0.5, "kl.coef": kl_coef}),
            temperature=0.9,
            total_steps=2,
        )
        batch, targets = _batch(actor.vocab_size), Targets(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        statistics = Statistics(old_logp=actor.compute_old_logp(batch))
        if kl_coef:
            statistics = Statistics(old_logp=statistics.old_logp, ref_logp=actor.compute_ref_logp(batch))
            actor.update(batch, targets, statistics, mini_batches=1)  # the policy moves off the reference: KL is live
        metrics = actor.update(batch, targets, statistics, mini_batches=1)
        return statistics.old_logp, actor.compute_old_logp(batch), metrics


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_actor") / "moe", seed=51))


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_update_at_ep2_equals_ep1(workers2, moe_dir, kl_coef):
    (old1, new1, m1), _ = workers2.run(_actor_numbers, moe_dir, 1, kl_coef)
    (old2, new2, m2), _ = workers2.run(_actor_numbers, moe_dir, 2, kl_coef)
    mask = _batch(10).response_mask
    rel = lambda a, b: ((a - b).abs() / b.abs().clamp_min(1e-12))[mask].max().item()  # noqa: E731
    print(
        f"kl_coef={kl_coef} EP=2 vs EP=1: old_logp rel {rel(old2, old1):.2e}, loss {m2['actor/loss']:.8g} vs {m1['actor/loss']:.8g}, "
        f"grad_norm {m2['actor/grad_norm']:.8g} vs {m1['actor/grad_norm']:.8g}, new logp rel {rel(new2, new1):.2e}"
    )
    assert rel(old2, old1) <= REL
    assert m2["actor/loss"] == pytest.approx(m1["actor/loss"], rel=REL)
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=REL)
    assert rel(new2, new1) <= REL
    assert (new1 - old1).abs()[mask].max() > 1e-4  # the update moved the policy
