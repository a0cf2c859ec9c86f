"""Experience collection: prompts -> sampled responses (each rollout-DP rank on its own engine) -> rewards ->
group advantages -> one padded `SequenceBatch`, identical on every rank.

Sampling seeds are a function of (run seed, step, rollout rank), so a resumed run regenerates exactly the rollouts
an uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.actor import SequenceBatch
from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.data import PromptItem
from megatron_rlvr.rollout import Completion, EngineDiedError, RolloutConfig, RolloutEngine, Sampling


@dataclass
class Experience:
    items: list[PromptItem]  # one per prompt
    completions: list[list[Completion]]  # [prompt][sample]
    rewards: torch.Tensor  # [prompts * G]
    batch: SequenceBatch
    engine_logp: torch.Tensor  # [B, S - 1] the engine's log-probs at response positions (0 elsewhere)
    reward_counters: dict[str, int]


def sampling_seed(run_seed: int, step: int, rollout_rank: int) -> int:
    return (run_seed * 1_000_003 + step * 10_007 + rollout_rank) % 2**31


def generate(
    engine: RolloutEngine, items: list[PromptItem], cfg: RolloutConfig, *, run_seed: int, step: int
) -> list[list[Completion]]:
    """Every rank of a rollout group generates its share of the prompts; all ranks get every completion. An engine
    that died on any rank raises EngineDiedError on every rank."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    rollout_dp, rollout_rank = world // cfg.tp, rank // cfg.tp
    mine = list(range(rollout_rank, len(items), rollout_dp))
    sampling = Sampling(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
        seed=sampling_seed(run_seed, step, rollout_rank), logprobs=True,
    )
    died = ""
    try:
        produced = engine.generate([list(items[i].prompt_ids) for i in mine], cfg.group_size, sampling) if mine else []
    except EngineDiedError as e:  # tell every rank (they are about to wait for this one), then fail together
        produced, died = [], f"rank {rank}: {e}"
    shares: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(shares, (mine, produced, died) if rank % cfg.tp == 0 else ([], [], died))
    else:
        shares = [(mine, produced, died)]
    deaths = [d for _, _, d in shares if d]
    if deaths:
        raise EngineDiedError("rollout engine died: " + "; ".join(deaths))
    completions: list[list[Completion] | None] = [None] * len(items)
    for indices, outputs, _ in shares:
        for i, out in zip(indices, outputs):
            completions[i] = out
    missing = [items[i].id for i, c in enumerate(completions) if c is None]
    if missing:
        raise RuntimeError(f"no completions came back for prompts {missing[:5]} (rollout ranks disagree)")
    return completions  # type: ignore[return-value]


def score(pool, items: list[PromptItem], completions: list[list[Completion]]) -> tuple[torch.Tensor, dict[str, int]]:
    """Rewards of every response, in (prompt, sample) order. Each rank scores a share; all ranks get all."""
    flat = [(item, c) for item, group in zip(items, completions) for c in group]
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    mine = list(range(rank, len(flat), world))
    rewards, counters = pool.score_batch(
        [flat[i][0].task for i in mine], [flat[i][1].text for i in mine], [flat[i][0].answer for i in mine]
    )
    shares: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(shares, (mine, rewards, counters))
    else:
        shares = [(mine, rewards, counters)]
    out = torch.zeros(len(flat))
    total: dict[str, int] = {}
    for indices, values, ctr in shares:
        out[indices] = torch.tensor(values, dtype=torch.float32)
        for key, value in ctr.items():
            total[key] = total.get(key, 0) + int(value)
    return out, total


def to_batch(
    items: list[PromptItem], completions: list[list[Completion]], advantages: torch.Tensor, pad_id: int
) -> tuple[SequenceBatch, torch.Tensor]:
    """Right-padded prompt + response sequences, one length for the whole step (pipeline stages exchange
    fixed-shape activations). Also the engine's per-token log-probs placed at the same positions."""
    seqs, spans, engine = [], [], []
    for item, group in zip(items, completions):
        for c in group:
            seqs.append(list(item.prompt_ids) + list(c.token_ids))
            spans.append((len(item.prompt_ids), len(c.token_ids)))
            engine.append(c.logprobs)
    length = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    engine_logp = torch.zeros(len(seqs), length - 1)
    for i, (seq, (p, r), lp) in enumerate(zip(seqs, spans, engine)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, p - 1 : p - 1 + r] = True  # position t predicts token t + 1
        if lp:
            engine_logp[i, p - 1 : p - 1 + len(lp)] = torch.tensor(lp[:r])
    return SequenceBatch(tokens, mask, advantages.float()), engine_logp


def collect(
    engine: RolloutEngine, pool, items: list[PromptItem], rollout_cfg: RolloutConfig, algo_cfg: AlgoConfig, *,
    pad_id: int, run_seed: int, step: int,
) -> Experience:
    completions = generate(engine, items, rollout_cfg, run_seed=run_seed, step=step)
    rewards, counters = score(pool, items, completions)
    advantages, keep = compute_advantages(rewards, rollout_cfg.group_size, algo_cfg)
    batch, engine_logp = to_batch(items, completions, advantages, pad_id)
    # groups dropped by dynamic sampling keep their place (fixed batch shape) but contribute no tokens
    batch.response_mask &= keep[:, None]
    return Experience(items, completions, rewards, batch, engine_logp, counters)
