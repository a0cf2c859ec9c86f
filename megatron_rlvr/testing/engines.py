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
