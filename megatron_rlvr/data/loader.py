"""Batches of prompts for the training loop: seeded shuffling per epoch and an exactly resumable position.

The order of epoch e is a pure function of (seed, e), so the state is just (epoch, position). A batch that runs
past the end of an epoch continues into the next epoch's order: every step gets exactly ``batch_size`` prompts.
``draw(n)`` takes n more prompts from the same stream (dynamic sampling's refill): the prompts a run sees depend only
on (seed, how many were drawn before), so a run that draws the same counts sees the same prompts, resumed or not.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from megatron_rlvr.data.dataset import PromptItem
from megatron_rlvr.data.sources import DataError


class PromptLoader:
    """``next_batch()`` yields ``batch_size`` items; ``state_dict()`` / ``load_state_dict()`` resume exactly."""

    def __init__(self, items: Sequence[PromptItem], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise DataError(f"prompts per step: expected >= 1, got {batch_size}")
        if not items:
            raise DataError("PromptLoader: the dataset has no prompts")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # items of the current epoch already handed out
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch, rounded up (the last one borrows from the next epoch)."""
        return -(-len(self.items) // self.batch_size)

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self) -> list[PromptItem]:
        return self.draw(self.batch_size)

    def draw(self, count: int) -> list[PromptItem]:
        """The next ``count`` prompts of the stream (across epochs, like next_batch)."""
        if count < 0:
            raise ValueError(f"PromptLoader.draw: expected a count >= 0, got {count}")
        batch: list[PromptItem] = []
        while len(batch) < count:
            order = self._order_of(self.epoch)
            take = min(count - len(batch), len(order) - self.position)
            batch.extend(self.items[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.items),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the dataset, seed and shuffle setting must be the ones the state was saved with."""
        for key, mine in (("num_items", len(self.items)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"data loader state: saved with {key}={state[key]!r} but this run has {key}={mine!r}; "
                    f"resuming would not reproduce the same prompts"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.items):
            raise DataError(
                f"data loader state: epoch={epoch}, position={position} out of range for {len(self.items)} prompts"
            )
        self.epoch, self.position = epoch, position
