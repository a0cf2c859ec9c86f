"""Experience collection: prompts -> sampled responses (each rollout-DP rank on its own engine) -> rewards ->
group advantages -> one `Experience` (its padded `Rollouts` and their `Targets`), identical on every rank.

Dynamic sampling (``algo.drop_uniform_groups``, DAPO): a group whose G rewards are all equal carries no signal. Such
groups are dropped and up to ``rollout.refill_max_rounds`` extra rounds draw and sample further prompts until the step
has ``trainer.prompts_per_step`` informative groups (extra ones beyond that are not trained); after the last round it
trains what it has. The batch keeps its shape (prompts_per_step groups): a short step is padded with dropped groups
whose tokens are masked out, so no layout or micro-batch split changes with the luck of the draw.

Routing replay (``actor.router_replay: rollout``, docs/routing-replay.md): each completion's
``Completion.routed_experts`` (the engine's experts of every prompt and response token) goes into
``Rollouts.routed_experts`` at the tokens' positions, -1 on padding; an engine that returned none is an error.
The ids move: the completions drop theirs once the rollouts hold them (the largest per-token payload of a step, sent
once over the wire under separate placement).

Determinism (exact resume): round r of step s samples with seeds that are a function of (run seed, s, r, rollout
rank), and the prompts come from the loader's stream in order, so a run that resumes at step s draws and samples
exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.data import PromptItem
from megatron_rlvr.environments import EpisodeEngine, Problem
from megatron_rlvr.errors import UserError
from megatron_rlvr.protocols.handoffs import Rollouts, Targets
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import Completion, EngineDiedError, RolloutConfig, RolloutEngine, Sampling

if TYPE_CHECKING:
    from megatron_rlvr.config import Config
    from megatron_rlvr.data import PromptLoader


class RoutingMissingError(UserError, ValueError):
    """actor.router_replay=rollout, but a completion came back without its routing, or with routing of another
    shape than its tokens."""


@dataclass(frozen=True)
class Experience:
    """One step's experience: what the actor trains on (``rollouts`` and their ``targets``) and what it came from.
    Nothing writes into it: a transform of it (experience/transforms.py) makes a new one."""

    items: list[PromptItem]  # the batch's prompts, one per group, in batch order
    completions: list[list[Completion]]  # [prompt][sample]
    rollouts: Rollouts  # [prompts * G] rows in (prompt, sample) order
    targets: Targets
    reward_counters: dict[str, int]
    # reward/*, response/* over every response sampled this step (all rounds); batch/* about what trains
    metrics: dict[str, float] = field(default_factory=dict)
    # streamed (docs/async.md): per response, the updates between its oldest token's weights and the step training it
    staleness: torch.Tensor | None = None


@dataclass
class Group:
    """One prompt's G responses, sampled in round ``round`` at position ``index`` of that round's draw (streamed:
    round 0, ``index`` its admission order)."""

    round: int
    index: int
    item: PromptItem
    completions: list[Completion]
    rewards: torch.Tensor  # [G], the overlong penalty included
    penalty: torch.Tensor  # [G] the overlong penalty (<= 0)

    @property
    def uniform(self) -> bool:
        return bool((self.rewards == self.rewards[0]).all())


def sampling_seed(run_seed: int, step: int, rollout_rank: int, refill_round: int = 0) -> int:
    return (run_seed * 1_000_003 + step * 10_007 + rollout_rank + refill_round * 7_919_993) % 2**31


def generate(
    engine: RolloutEngine,
    items: list[PromptItem],
    cfg: RolloutConfig,
    *,
    run_seed: int,
    step: int,
    refill_round: int = 0,
) -> list[list[Completion]]:
    """Every rank of a rollout group generates its share of the prompts; all ranks get every completion. An engine
    that died on any rank raises EngineDiedError on every rank. The ranks that drive one engine together are
    ``rollout.tp`` colocated ranks, or the engine's own ``ranks_per_engine`` (the engine ranks seen from the actor:
    each actor rank asks for itself)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    tp = engine.ranks_per_engine or cfg.tp
    rollout_dp, rollout_rank = world // tp, rank // tp
    mine = list(range(rollout_rank, len(items), rollout_dp))
    sampling = Sampling(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_new_tokens,
        min_tokens=cfg.min_new_tokens,
        stop=list(cfg.stop),
        seed=sampling_seed(run_seed, step, rollout_rank, refill_round),
        logprobs=True,
    )
    died = ""
    try:
        if not mine:
            produced = []
        elif isinstance(engine, EpisodeEngine):  # multi-turn: trajectories against environments (docs/multi-turn.md)
            produced = engine.play([problem_of(items[i]) for i in mine], cfg.group_size, sampling)
        else:
            produced = engine.generate([list(items[i].prompt_ids) for i in mine], cfg.group_size, sampling)
    except EngineDiedError as e:  # tell every rank (they are about to wait for this one), then fail together
        produced, died = [], f"rank {rank}: {e}"
    shares: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(shares, (mine, produced, died) if rank % tp == 0 else ([], [], died))
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


def problem_of(item: PromptItem) -> Problem:
    return Problem(item.id, item.prompt, tuple(item.prompt_ids), item.task, item.answer)


def verify(
    pool: RewardPool, items: list[PromptItem], completions: list[list[Completion]], *, shared: bool = True
) -> tuple[torch.Tensor, dict[str, int]]:
    """The verifiers' rewards of every response, in (prompt, sample) order. ``shared``: each rank scores a share and
    all ranks get all; otherwise this rank scores them all alone."""
    flat = [(item, c) for item, group in zip(items, completions) for c in group]
    world, rank = (dist.get_world_size(), dist.get_rank()) if shared and dist.is_initialized() else (1, 0)
    mine = list(range(rank, len(flat), world))
    # a multi-turn response's reward is its environment's return (docs/multi-turn.md); the pool scores the rest
    pooled = [i for i in mine if flat[i][1].episode is None]
    pool_rewards, counters = (
        pool.score_batch(
            [flat[i][0].task for i in pooled], [flat[i][1].text for i in pooled], [flat[i][0].answer for i in pooled]
        )
        if pooled
        else ([], {})
    )
    by_index = dict(zip(pooled, pool_rewards))
    counters = dict(counters)
    for i in mine:
        episode = flat[i][1].episode
        if episode is not None:
            by_index[i] = episode.env_return
            if episode.failure:
                counters[f"env_{episode.failure}"] = counters.get(f"env_{episode.failure}", 0) + 1
    rewards = [by_index[i] for i in mine]
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


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft length penalty per response of ``lengths`` tokens: 0 up to ``L_max - L_c``, then falling linearly
    to ``-penalty`` at the budget ``L_max`` (``penalty * (L_max - L_c - L) / L_c``), and ``-penalty`` beyond."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = max_new_tokens - buffer
    over = ((start - lengths.double()) / buffer).clamp(-1.0, 0.0)
    return (penalty * over).to(torch.float32)


def _sample_round(
    engine: RolloutEngine,
    pool,
    items: list[PromptItem],
    cfg: Config,
    *,
    run_seed: int,
    step: int,
    refill_round: int,
    counters: dict[str, int],
) -> list[Group]:
    completions = generate(engine, items, cfg.rollout, run_seed=run_seed, step=step, refill_round=refill_round)
    rewards, round_counters = verify(pool, items, completions)
    for key, value in round_counters.items():
        counters[key] = counters.get(key, 0) + value
    g = cfg.rollout.group_size
    return [
        group_of(refill_round, i, item, group, rewards[i * g : (i + 1) * g], cfg)
        for i, (item, group) in enumerate(zip(items, completions))
    ]


def group_of(
    refill_round: int, index: int, item: PromptItem, completions: list[Completion], rewards: torch.Tensor, cfg: Config
) -> Group:
    """One prompt's scored responses as a `Group`, with DAPO's overlong penalty added to ``rewards``."""
    lengths = torch.tensor([len(c.token_ids) for c in completions])
    penalty = overlong_penalty(
        lengths, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty
    )
    return Group(refill_round, index, item, completions, rewards + penalty, penalty)


def _refill_count(missing: int, drawn: int, informative: int, prompts_per_step: int) -> int:
    """Prompts to draw for ``missing`` informative groups: as many as this step's informative rate so far predicts
    (a full batch when none was informative), at least ``missing``, at most one batch's worth."""
    if informative == 0:
        return prompts_per_step
    return max(missing, min(prompts_per_step, math.ceil(missing * drawn / informative)))


def collect(
    engine: RolloutEngine, pool, loader: PromptLoader, cfg: Config, *, pad_id: int, run_seed: int, step: int
) -> Experience:
    """One step's experience from ``loader.batch_size`` prompts (more with dynamic sampling, see the module doc).
    The loader advances by every prompt drawn; a caller retrying a failed collect restores its state first."""
    want, refill = loader.batch_size, cfg.algo.drop_uniform_groups
    counters: dict[str, int] = {}
    groups = _sample_round(
        engine, pool, loader.next_batch(), cfg, run_seed=run_seed, step=step, refill_round=0, counters=counters
    )
    rounds = 0
    while refill and rounds < cfg.rollout.refill_max_rounds:
        informative = sum(not g.uniform for g in groups)
        if informative >= want:
            break
        rounds += 1
        items = loader.draw(_refill_count(want - informative, len(groups), informative, want))
        groups += _sample_round(
            engine, pool, items, cfg, run_seed=run_seed, step=step, refill_round=rounds, counters=counters
        )
    chosen = _choose_groups(groups, want, refill)
    return assemble(chosen, groups, cfg, pad_id=pad_id, counters=counters, rounds=rounds, refill=refill)


def assemble(
    chosen: list[Group],
    sampled: list[Group],
    cfg: Config,
    *,
    pad_id: int,
    counters: dict[str, int],
    rounds: int,
    refill: bool,
) -> Experience:
    """The `Experience` that trains ``chosen`` (in batch order); the metrics cover every group ``sampled`` for this
    step (the chosen ones and those dynamic sampling dropped)."""
    rewards = torch.cat([g.rewards for g in chosen])
    advantages, keep = compute_advantages(rewards, cfg.rollout.group_size, cfg.algo)
    items, completions = [g.item for g in chosen], [g.completions for g in chosen]
    # dropped groups padding a short step keep their place (fixed batch shape) but contribute no tokens
    rollouts = to_rollouts(
        items,
        completions,
        rewards,
        pad_id,
        trains=keep & untruncated(completions, cfg.algo.mask_truncated),
        routed_experts=cfg.actor.router_replay == "rollout",
    )
    trained = sum(not g.uniform for g in chosen) if refill else len(chosen)
    metrics = _sampled_metrics(sampled, cfg.reward.overlong_buffer > 0)
    metrics.update(
        {
            "batch/uniform_groups_dropped": float(sum(g.uniform for g in sampled)) if refill else 0.0,
            "batch/refill_rounds": float(rounds),
            "batch/groups_trained": float(trained),
        }
    )
    return Experience(items, completions, rollouts, Targets(advantages=advantages.float()), counters, metrics)


def untruncated(completions: list[list[Completion]], mask_truncated: bool) -> torch.Tensor:
    """[B] bool: the responses that may train under DAPO's overlong filtering (``algo.mask_truncated``: not one cut
    at the token budget; otherwise every one)."""
    flat = [c for group in completions for c in group]
    if not mask_truncated:
        return torch.ones(len(flat), dtype=torch.bool)
    return ~torch.tensor([c.finish_reason == "length" for c in flat])


def _choose_groups(groups: list[Group], want: int, refill: bool) -> list[Group]:
    """The step's ``want`` groups in draw order: without dropping, the first round's; with it, the first ``want``
    informative ones, topped up with dropped groups (masked out later) when the rounds ran out."""
    if not refill:
        return groups[:want]
    informative = [g for g in groups if not g.uniform][:want]
    padding = [g for g in groups if g.uniform][: want - len(informative)]
    return sorted(informative + padding, key=lambda g: (g.round, g.index))


def _sampled_metrics(groups: list[Group], penalized: bool) -> dict[str, float]:
    """The policy's behaviour on every prompt it sampled this step (all rounds: each an unbiased draw of prompts)."""
    rewards = torch.cat([g.rewards for g in groups])
    responses = [c for g in groups for c in g.completions]
    prefixed = torch.tensor([c.prefix_len > 0 for c in responses])
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "response/length": sum(len(c.token_ids) for c in responses) / len(responses),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in responses) / len(responses),
        "rollout/prefix_frac": float(prefixed.float().mean()),  # responses that continue a weaker model's prefix
    }
    if prefixed.any():
        metrics["reward/mean_prefixed"] = float(rewards[prefixed].mean())
    episodes = [c.episode for c in responses if c.episode is not None]
    if episodes:  # multi-turn: how often the policy called its tool (took an observation) before answering
        metrics["rollout/tool_call_rate"] = sum(e.turns > 1 for e in episodes) / len(episodes)
        metrics["rollout/turns"] = sum(e.turns for e in episodes) / len(episodes)
        metrics["rollout/env_tokens"] = sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes) / len(episodes)
    if penalized:
        metrics["reward/overlong_penalty"] = float(torch.cat([g.penalty for g in groups]).mean())
    return metrics


def to_rollouts(
    items: list[PromptItem],
    completions: list[list[Completion]],
    rewards: torch.Tensor,
    pad_id: int,
    *,
    trains: torch.Tensor | None = None,
    routed_experts: bool = False,
) -> Rollouts:
    """Right-padded prompt + response sequences, one length for the whole step (pipeline stages exchange
    fixed-shape activations), with the engine's per-token log-probs at the same positions (what the rollout
    correction reads) and the ``rewards`` [B]. ``trains`` [B] bool: the rows whose response tokens train (default
    all); the others keep their place with an empty mask. The first ``Completion.prefix_len`` response tokens (a
    weaker model's prefix) are context only: masked out.
    ``routed_experts``: the engine's routing of every sequence, placed like its tokens (`routed_experts_of`).
    A multi-turn response (``Completion.episode``) follows its own prompt when its environment replaced the data's,
    and trains only its sampled tokens: the episode's loss mask is 0 on the environment's (docs/multi-turn.md)."""
    seqs, spans, engine, prefixes, env_masks = [], [], [], [], []
    for item, group in zip(items, completions):
        for c in group:
            episode = c.episode
            prompt = item.prompt_ids if episode is None or episode.prompt_ids is None else episode.prompt_ids
            seqs.append(list(prompt) + list(c.token_ids))
            spans.append((len(prompt), len(c.token_ids)))
            engine.append(c.logprobs)
            prefixes.append(min(c.prefix_len, len(c.token_ids)))
            env_masks.append(None if episode is None else episode.loss_mask)
    length = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    engine_logp = torch.zeros(len(seqs), length - 1)
    for i, (seq, (p, r), lp, k, env) in enumerate(zip(seqs, spans, engine, prefixes, env_masks)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, p - 1 + k : p - 1 + r] = True  # position t predicts token t + 1
        if env is not None:  # the environment's tokens (tool output, template glue) never train
            mask[i, p - 1 : p - 1 + r] &= torch.tensor(env[:r], dtype=torch.bool)
        if lp:
            engine_logp[i, p - 1 : p - 1 + len(lp)] = torch.tensor(lp[:r])
    if trains is not None:
        mask &= trains[:, None]
    routed = routed_experts_of([c for group in completions for c in group], spans, length) if routed_experts else None
    return Rollouts(
        tokens=tokens, response_mask=mask, routed_experts=routed, engine_logp=engine_logp, rewards=rewards.float()
    )


def routed_experts_of(completions: list[Completion], spans: list[tuple[int, int]], length: int) -> torch.Tensor:
    """Each completion's [prompt + response tokens, MoE layers, top_k] expert ids -> [B, length, L, k] int16,
    right-padded with -1 like the tokens (-1: no routing known; the actor's router chooses there). An engine may
    leave out the last token (never fed back to the model): its row is -1 too. The completions give theirs up
    (None afterwards); on an error nothing has changed."""
    rows = []
    for i, (c, (p, r)) in enumerate(zip(completions, spans)):
        ids = c.routed_experts
        if ids is None:
            raise RoutingMissingError(
                "actor.router_replay=rollout: the rollout engine returned no routed_experts for completion "
                f"{i} (an engine that captures its MoE routing is needed, or actor.router_replay=none|train)"
            )
        ids = torch.as_tensor(ids)
        if ids.dim() != 3 or ids.shape[0] not in (p + r, p + r - 1) or (rows and ids.shape[1:] != rows[0].shape[1:]):
            want = (
                f"[{p + r}, MoE layers, top_k]" if not rows else f"[{p + r}, {', '.join(map(str, rows[0].shape[1:]))}]"
            )
            raise RoutingMissingError(
                f"Completion.routed_experts of completion {i}: expected {want} (prompt + response tokens), "
                f"got {list(ids.shape)}"
            )
        rows.append(ids)
    out = torch.full((len(rows), length, *rows[0].shape[1:]), -1, dtype=torch.int16)
    for i, ids in enumerate(rows):
        out[i, : ids.shape[0]] = ids.to(torch.int16)
    for c in completions:  # moved, not copied: the rollouts hold them now
        c.routed_experts = None
    return out
