"""The rollout protocols: every engine (vLLM on GPU, vLLM on CPU, test fakes) implements `RolloutEngine`; an engine that
also generates one engine step at a time, so that its weights can change between steps, gives a `StreamingEngine`
(fully asynchronous training, docs/async.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class Sampling:
    """How to sample; `n` responses per prompt is passed to `generate` beside it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # no end (EOS, stop string) before this many tokens: fixes the length of answers for benchmarks (vLLM min_tokens)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True  # return the sampled token's log-prob per generated token


@dataclass
class Completion:
    """One sampled response: generated token ids (prompt excluded), their log-probs under the engine, and text.

    ``prefix_len``: the first ``prefix_len`` entries of ``token_ids`` (and of ``logprobs``) were written by a weaker
    model (rollout/prefixes.py): context for the policy, never trained; the rest is the engine's own continuation.

    ``routed_experts``: MoE engines that capture their routing: [prompt + response tokens, MoE layers, top_k] expert
    ids, the experts each token of the sequence went to (what ``actor.router_replay: rollout`` replays). The last
    token's row is -1 where the engine never ran it through the model (vLLM: the last sampled token, whose routing
    affects no log-prob of the sequence); rollout/routed_experts.py.

    ``versions``: streamed responses (docs/async.md): the weight version that sampled each token of ``token_ids``
    (non-decreasing; more than one value when weights changed while it was in flight). None: one version sampled the
    whole response (the step's, `experience.wire.Rollout.version`).

    ``episode``: a multi-turn response (docs/multi-turn.md): ``token_ids`` then holds the policy's sampled tokens and
    the environment's tokens between its turns, and the episode says which is which and what the environment paid."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prefix_len: int = 0
    routed_experts: torch.Tensor | None = None
    versions: list[int] | None = None
    episode: Episode | None = None


@dataclass
class Episode:
    """What an environment added to a `Completion` (docs/multi-turn.md).

    ``loss_mask[t]`` is 1 where ``token_ids[t]`` was sampled by the policy (its ``logprobs[t]`` is the engine's) and 0
    where the environment wrote it (tool output, chat-template glue; its ``logprobs[t]`` is 0 and never read).
    ``env_return`` is the sum of the environment's per-turn rewards: the response's reward, in place of the reward
    pool's score. ``prompt_ids``: the prompt the first turn continued when the environment's ``reset`` replaced the
    data's prompt, else None. ``failure``: "" or how the environment failed ("timeout", "crash", "error", "lost"),
    which ended the episode with the return so far."""

    loss_mask: list[int]
    env_return: float
    turns: int  # the policy's turns; turns - 1 environment observations came between them
    prompt_ids: list[int] | None = None
    failure: str = ""


_PROMPT_SEED_STRIDE = 104_729  # a prime above any n: the n samples of one prompt never reuse another's seeds


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of the ``index``-th prompt of one `generate` call (its j-th response: that + j). vLLM seeds each
    request alone, so one seed for all would give every prompt the same random draws (the same prompt twice: the same
    samples)."""
    return None if seed is None else (seed + index * _PROMPT_SEED_STRIDE) % 2**31


class EngineDiedError(RuntimeError):
    """The engine process or its in-process state is gone; the trainer rebuilds it from the actor's weights."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine is to the rest of the system; nothing reads an engine beyond this."""

    # how many ranks drive this engine together (its generate is a collective over them); None: the colocated
    # rollout.tp ranks of the recipe
    ranks_per_engine: int | None

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        """Load a stream of (HF parameter name, tensor) into the engine's model. ``lent``: a tensor is valid only
        until the engine draws the next bucket of the stream (the bridge's ``lend=True``); copy what must outlive it."""

    def sleep(self) -> None:
        """Free the engine's accelerator memory (weights and KV cache) while the actor trains."""

    def wake(self) -> None:
        """Undo `sleep`."""

    @property
    def alive(self) -> bool:
        """False once the engine died (it raised `EngineDiedError`); the caller rebuilds it."""

    def close(self) -> None:
        """Release the engine now (not from ``__del__`` at interpreter exit). Idempotent."""


@dataclass
class Progress:
    """What one engine step did for one response: the tokens it sampled, their log-probs and text, and its end."""

    key: str  # the request (prompt) it belongs to
    index: int  # which of the request's n responses
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None  # None while it runs; then "stop" or "length"


@dataclass
class PrefixCacheCounts:
    """What the prefix cache saved (rollout/prefix_cache.py): the prompt tokens of the responses that started
    (``queries``) and how many of them came from cached KV blocks (``hits``)."""

    queries: int = 0
    hits: int = 0

    def add(self, other: PrefixCacheCounts) -> None:
        self.queries += other.queries
        self.hits += other.hits


@runtime_checkable
class StreamingEngine(Protocol):
    """Requests in flight, advanced one engine step at a time; weights change between steps (docs/async.md)."""

    def submit(self, key: str, prompt_token_ids: list[int], n: int, sampling: Sampling) -> None:
        """Start ``n`` responses to one prompt under ``key``, the j-th seeded ``sampling.seed + j``."""

    def step(self) -> list[Progress]:
        """One engine step over every request in flight; what it sampled, per response."""

    def in_flight(self) -> int:
        """Requests with a response still running."""

    def refresh_kv(self) -> None:
        """Recompute the running requests' KV cache with the weights now loaded, and empty the prefix cache."""

    def cancel(self) -> None:
        """Abort every request in flight."""

    def take_prefix_cache_counts(self) -> PrefixCacheCounts:
        """The prefix cache's counts over the responses that started since the last call."""
