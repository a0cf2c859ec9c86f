"""The environment protocol of multi-turn rollouts (docs/multi-turn.md), declared like `rollout.RolloutEngine`.

An `Environment` is one trajectory's counterpart: ``reset(problem)`` once, then ``step(text)`` after every turn of
the policy, which answers ``(observation, reward, done)``. The policy's next turn continues the running token
prefix: its own sampled ids, then the observation in the model's chat template (loss mask 0). A trajectory ends when
the environment says done, at ``environment.max_turns`` turns, or when its token budget is spent. Its reward is its
return, the sum of the per-turn rewards; the group advantage is computed on that return, like any response's reward.

Environments run in worker processes (`host.py`), so what they hold and return must pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, runtime_checkable

from megatron_rlvr.rollout import Completion, Sampling


class Message(TypedDict):
    role: str
    content: str


@dataclass(frozen=True)
class Problem:
    """What an environment is told about its trajectory's problem: the data row's fields."""

    id: str
    prompt: str  # the text the policy's first turn continues (after the chat template, when that is on)
    prompt_ids: tuple[int, ...]
    task: str  # the reward task name (rewards.scoring)
    answer: Any  # the row's reference, as the verifier reads it


@dataclass(frozen=True)
class Step:
    observation: str  # shown to the policy before its next turn ("" when done)
    reward: float  # this turn's reward; the trajectory's return is the sum
    done: bool


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment; a fresh one per trajectory."""

    def reset(self, problem: Problem) -> list[Message]:
        """Start the trajectory. Empty: the policy's first turn continues the data's prompt. Otherwise these
        messages, in the model's chat template with the generation prompt, replace it."""

    def step(self, response: str) -> Step:
        """The policy's last turn (its text, the stop string excluded) -> the observation, the turn's reward, done."""


@runtime_checkable
class EpisodeEngine(Protocol):
    """An engine that plays whole trajectories against environments (`episodes.EpisodeRunner`): what experience
    collection calls in place of `RolloutEngine.generate` when ``environment.name`` is set."""

    def play(self, problems: list[Problem], n: int, sampling: Sampling) -> list[list[Completion]]:
        """``n`` trajectories per problem, in problem order; each `Completion` carries its `rollout.Episode`;
        ``sampling.max_tokens`` is each trajectory's token budget after its prompt."""
