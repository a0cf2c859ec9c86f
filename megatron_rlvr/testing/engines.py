"""A base for test engines that script only `generate`: the rest of the `RolloutEngine` protocol, done plainly
(the recipe's rollout.tp ranks per engine, no weights to load, no memory to free, alive until closed)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ScriptedEngineBase:
    ranks_per_engine: int | None = None
    closed: bool = False

    def update_weights(self, weights: Iterable[tuple[str, Any]], lent: bool = False) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a scripted test engine: it has no weights to load")

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True


class ScriptedStream:
    """A `StreamingEngine` for tests: every running response gains one token per `step`. ``length(key, j, prompt)``
    says how many tokens response j of a request has in all (cut at ``sampling.max_tokens``: "length"), ``text(key, j,
    prompt)`` its text, reported with its last token. Token t of a response is ``100 + t``, its log-prob
    ``-0.01 * (t + 1)``; ``steps`` counts the steps that ran, ``refreshed`` the `refresh_kv` calls."""

    def __init__(self, length: Any, text: Any = lambda key, j, prompt: "yes") -> None:
        self.length, self.text = length, text
        self.running: dict[str, list[list[Any]]] = {}  # key -> per response [prompt, j, produced, total, max_tokens]
        self.steps = self.refreshed = 0
        self.submitted: list[tuple[str, list[int], int, Any]] = []

    def submit(self, key: str, prompt_token_ids: list[int], n: int, sampling: Any) -> None:
        if key in self.running:
            raise ValueError(f"request {key!r} is in flight already")
        self.submitted.append((key, list(prompt_token_ids), n, sampling))
        self.running[key] = [
            [list(prompt_token_ids), j, 0, max(1, self.length(key, j, prompt_token_ids)), sampling.max_tokens]
            for j in range(n)
        ]

    def step(self) -> list[Any]:
        from megatron_rlvr.rollout.base import Progress

        news = []
        self.steps += 1
        for key, responses in list(self.running.items()):
            for r in responses:
                prompt, j, produced, total, budget = r
                if produced >= min(total, budget):
                    continue
                r[2] = produced + 1
                end = r[2] == min(total, budget)
                reason = ("length" if total > budget else "stop") if end else None
                text = self.text(key, j, prompt) if end else ""
                news.append(Progress(key, j, [100 + produced], [-0.01 * (produced + 1)], text, reason))
            if all(r[2] >= min(r[3], r[4]) for r in responses):
                del self.running[key]
        return news

    def in_flight(self) -> int:
        return len(self.running)

    def refresh_kv(self) -> None:
        self.refreshed += 1

    def cancel(self) -> None:
        self.running.clear()

    def take_prefix_cache_counts(self) -> Any:
        from megatron_rlvr.rollout.base import PrefixCacheCounts

        return PrefixCacheCounts()  # no KV cache here: nothing queried, nothing hit
