"""The episode runner: trajectories of several turns, played token in, token out (docs/multi-turn.md).

`EpisodeRunner` wraps a `RolloutEngine` (and is one, by delegation) and adds `play` (`base.EpisodeEngine`). Each
trajectory keeps its running ids: the prompt, then per turn the policy's sampled ids (with the engine's log-probs,
loss mask 1) and the environment's ids (observation in the chat template, log-prob 0, loss mask 0; `glue.TurnGlue`).
Every turn of every live trajectory is one request continuing those exact ids, so the engine reads its prefix from
its prefix cache and the actor later trains on exactly the ids the engine saw; text is decoded for the environment,
never encoded back.

Budget: every id after the prompt counts against ``sampling.max_tokens`` (``rollout.max_new_tokens``). A turn may
sample what is left (at most ``environment.turn_max_tokens`` when set), and an observation that would leave no room
for another sampled token ends the trajectory ("length").

Sampling: the first turn is drawn exactly as single-turn generation draws it (one request per problem with ``n``
responses and ``sampling.seed``), unless an environment's reset replaced a prompt. Later turns' requests are grouped
by what is left, one engine call per distinct budget (the engine seeds each request of a call by its place in it,
`rollout.prompt_seed`); turn k's call for budget b has the seed ``seed + k * _TURN_STRIDE + b * _BUDGET_STRIDE``, so
the same run samples the same trajectories.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from megatron_rlvr.environments.base import Problem
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.environments.glue import TurnGlue
from megatron_rlvr.environments.host import EnvironmentHost
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rollout import Completion, Episode, RolloutEngine, Sampling

if TYPE_CHECKING:
    import torch

_TURN_STRIDE = 1_000_003
_BUDGET_STRIDE = 7_919


@dataclass
class _Trajectory:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    env_return: float = 0.0
    turns: int = 0
    finish: str = "stop"
    failure: str = ""
    replaced_prompt: bool = False
    done: bool = False
    env_alive: bool = False  # its environment holds state in a worker (released by a "drop" when the runner ends it)


class EpisodeRunner:
    """A `RolloutEngine` that also plays episodes against ``cfg.name``'s environments."""

    def __init__(
        self, engine: RolloutEngine, cfg: EnvironmentConfig, glue: TurnGlue, reward: RewardConfig | None = None
    ):
        self.engine = engine
        self.cfg = cfg
        self.glue = glue
        self.host = EnvironmentHost(cfg, reward)  # reward: the verifiers the built-in tool scores answers with
        self.ranks_per_engine = engine.ranks_per_engine

    # the RolloutEngine protocol, by delegation
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        return self.engine.generate(prompt_token_ids, n, sampling)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        self.engine.update_weights(weights, lent)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def close(self) -> None:
        self.host.close()
        self.engine.close()

    def play(self, problems: list[Problem], n: int, sampling: Sampling) -> list[list[Completion]]:
        self.host.forget()
        trajs = [_Trajectory(list(p.prompt_ids)) for p in problems for _ in range(n)]
        resets = self.host.call([("reset", t, problems[t // n]) for t in range(len(trajs))])
        for traj, outcome in zip(trajs, resets):
            if outcome.failure:
                traj.failure, traj.done = outcome.failure, True
                continue
            traj.env_alive = True
            if outcome.value:
                traj.prompt, traj.replaced_prompt = self.glue.prompt(outcome.value), True
        for turn in range(self.cfg.max_turns):
            live = [t for t, traj in enumerate(trajs) if not traj.done]
            if not live:
                break
            if turn == 0 and len(live) == len(trajs) and not any(traj.replaced_prompt for traj in trajs):
                self._sample_first_turn(trajs, problems, n, sampling)
            else:
                self._sample_turn(trajs, live, turn, sampling)
            steps = self.host.call([("step", t, trajs[t].texts[-1]) for t in live])
            for t, outcome in zip(live, steps):
                self._take_step(trajs[t], outcome, sampling.max_tokens, last_turn=turn + 1 == self.cfg.max_turns)
        ends = [t for t, traj in enumerate(trajs) if traj.env_alive]
        if ends:  # trajectories cut by the runner: their environments are released
            self.host.call([("drop", t, None) for t in ends])
        completions = [self._completion(traj) for traj in trajs]
        return [completions[i * n : (i + 1) * n] for i in range(len(problems))]

    def _sample_first_turn(self, trajs: list[_Trajectory], problems: list[Problem], n: int, sampling: Sampling) -> None:
        """The first turn exactly as single-turn generation draws it (one request per problem, ``n`` responses, the
        same seeds): a policy that never calls its tool samples the same responses with and without it."""
        cap = min(sampling.max_tokens, self.cfg.turn_max_tokens or sampling.max_tokens)
        outputs = self.engine.generate([list(p.prompt_ids) for p in problems], n, replace(sampling, max_tokens=cap))
        for t, c in enumerate(c for group in outputs for c in group):
            self._extend(trajs[t], c)

    def _extend(self, traj: _Trajectory, c: Completion) -> None:
        traj.ids += c.token_ids
        traj.logprobs += c.logprobs
        traj.mask += [1] * len(c.token_ids)
        traj.texts.append(c.text)
        traj.turns += 1
        traj.finish = c.finish_reason

    def _sample_turn(self, trajs: list[_Trajectory], live: list[int], turn: int, sampling: Sampling) -> None:
        by_budget: dict[int, list[int]] = {}
        for t in live:
            left = sampling.max_tokens - len(trajs[t].ids)
            by_budget.setdefault(min(left, self.cfg.turn_max_tokens or left), []).append(t)
        base = None if sampling.seed is None else sampling.seed + turn * _TURN_STRIDE
        for budget, members in sorted(by_budget.items()):
            seed = None if base is None else (base + budget * _BUDGET_STRIDE) % 2**31
            per = replace(sampling, max_tokens=budget, seed=seed)
            outputs = self.engine.generate([trajs[t].prompt + trajs[t].ids for t in members], 1, per)
            for t, (c,) in zip(members, outputs):
                self._extend(trajs[t], c)

    def _take_step(self, traj: _Trajectory, outcome, budget: int, last_turn: bool) -> None:
        if outcome.failure:
            traj.failure, traj.done, traj.env_alive = outcome.failure, True, False
            return
        step = outcome.value
        traj.env_return += step.reward
        if step.done:  # the environment ended it: cut only if the budget cut its last turn
            traj.done, traj.env_alive = True, False
            traj.finish = "length" if len(traj.ids) >= budget else "stop"
            return
        if last_turn or len(traj.ids) >= budget:
            traj.done, traj.finish = True, "length"
            return
        glue = self.glue.observation(step.observation, traj.ids)
        if len(traj.ids) + len(glue) >= budget:  # no room left for a sampled token after it
            traj.done, traj.finish = True, "length"
            return
        traj.ids += glue
        traj.logprobs += [0.0] * len(glue)
        traj.mask += [0] * len(glue)

    def _completion(self, traj: _Trajectory) -> Completion:
        episode = Episode(
            loss_mask=traj.mask,
            env_return=traj.env_return,
            turns=traj.turns,
            prompt_ids=traj.prompt if traj.replaced_prompt else None,
            failure=traj.failure,
        )
        text = traj.texts[-1] if traj.texts else ""
        return Completion(traj.ids, traj.logprobs, text, traj.finish, episode=episode)
