"""In-training validation: every `trainer.eval_every` steps the rollout engines sample `eval.n_samples` answers per
held-out prompt; the verifier's verdicts give val/pass@k, and the actor's per-token entropy over those answers is
the entropy histogram of that step (the candidate-dynamics view the CaSP paper plots).

The held-out prompts are `eval.benchmarks` (files under `eval.data_dir`, as `megatron-rlvr eval` reads them) when
any are named, else the dataset's eval split (`data.eval_path`, or the embedded task's). Every validation samples
with the same seeds, so the differences between steps are the model's, not the sampler's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem, items_from_rows, load_items, problem_rows
from megatron_rlvr.eval.passk import pass_at_k
from megatron_rlvr.experience.collect import generate, to_rollouts, verify
from megatron_rlvr.protocols.actor import EntropyScorer
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import RolloutEngine
from megatron_rlvr.rollout.prefixes import without_prefixes

# Training rollouts use sampling_seed(run seed, step >= 0, rank): a negative step keeps validation seeds apart.
_VALIDATION_STEP = -1


def load_validation_items(cfg: Config, tokenizer) -> list[PromptItem]:
    """The held-out prompts, tokenized under the data settings (template, length limit), `eval.limit` per source."""
    limit = cfg.eval.limit or None
    if not cfg.eval.benchmarks:
        return load_items(cfg.data, tokenizer, "eval")[0][:limit]
    from megatron_rlvr.problems.benchmarks import load_benchmark

    data_cfg = dataclasses.replace(
        cfg.data, chat_template=cfg.eval.chat_template, system_prompt=cfg.eval.system_prompt, skip_bad_rows=False
    )
    items: list[PromptItem] = []
    for bench in cfg.eval.benchmarks:
        rows = problem_rows(load_benchmark(bench, cfg.eval.data_dir, limit), data_cfg)
        items += items_from_rows(rows, data_cfg, tokenizer)[0]
    if not items:
        raise ValueError(
            f"eval.benchmarks={cfg.eval.benchmarks}: no prompt fits data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
        )
    return items


def pass_at_k_metrics(correct: np.ndarray, n_samples: int) -> dict[str, float]:
    """Mean pass@k over prompts, k = 1, 2, 4, ... up to n_samples (and n_samples itself)."""
    ks = sorted({k for k in (2**i for i in range(n_samples.bit_length())) if k <= n_samples} | {n_samples})
    return {f"val/pass@{k}": float(np.mean(pass_at_k(n_samples, correct, k))) for k in ks}


def validate(
    engine: RolloutEngine, pool: RewardPool, actor: EntropyScorer, items: list[PromptItem], cfg: Config, pad_id: int
) -> tuple[dict[str, float], np.ndarray]:
    """Sample, verify and measure; a collective over all ranks. Returns the val/ metrics and the per-token
    entropies (nats) of every sampled answer token under the actor."""
    e = cfg.eval
    rollout_cfg = dataclasses.replace(
        cfg.rollout,
        group_size=e.n_samples,
        temperature=e.temperature,
        top_p=e.top_p,
        max_new_tokens=e.max_new_tokens,
        stop=list(e.stop) or list(cfg.rollout.stop),
    )
    completions = generate(without_prefixes(engine), items, rollout_cfg, run_seed=e.seed, step=_VALIDATION_STEP)
    rewards, _ = verify(pool, items, completions)
    correct = (rewards.view(len(items), e.n_samples) >= 1.0).sum(-1).numpy()
    rollouts = to_rollouts(items, completions, rewards, pad_id)
    entropy = actor.compute_entropy(rollouts)[rollouts.response_mask].numpy()
    lengths = [len(c.token_ids) for group in completions for c in group]
    metrics = {
        "val/reward_mean": float(rewards.mean()),
        **pass_at_k_metrics(correct, e.n_samples),
        "val/entropy": float(entropy.mean()) if entropy.size else 0.0,
        "val/response_length": float(np.mean(lengths)),
    }
    return metrics, entropy
