"""What became of every admitted group, counted apart from the admission ledger (admission.py), so that
``async/dropped`` checks the ledger instead of restating its arithmetic (docs/async.md).

Groups are numbered by admission (0, 1, 2, ...). A group *leaves* when a step trains it or dynamic sampling drops it;
the account records those ids as the groups themselves go (`leave`, from the groups a step holds and the groups it
filtered). A group that has not left must be *present*: running on some replica (each replica reports the ids it
runs) or finished and held by the shipper. ``dropped`` counts the admitted ids that are neither: a group whose
report was lost, that a resume did not put back, or that left the ledger without training. A group that leaves twice
is an error at once: it would train twice.

Ids that left are kept as a floor (every id below it left) and the set above it, so the account stays small: the
groups in flight span at most (k + 1) N admissions.
"""

from __future__ import annotations

from collections.abc import Iterable


class GroupAccount:
    """See the module doc. ``floor`` / ``above``: a checkpoint's `state`."""

    def __init__(self, floor: int = 0, above: Iterable[int] = ()) -> None:
        self.floor = floor
        self.left: set[int] = set(above)

    def leave(self, ids: Iterable[int], how: str) -> None:
        """Groups ``ids`` left the stream (``how``: "trained" or "filtered")."""
        for i in ids:
            if i < self.floor or i in self.left:
                raise RuntimeError(f"group {i} {how}, but it had left the stream already")
            self.left.add(i)
        while self.floor in self.left:
            self.left.remove(self.floor)
            self.floor += 1

    def dropped(self, admitted: int, present: set[int]) -> int:
        """Ids below ``admitted`` that neither left nor are ``present``."""
        return sum(1 for i in range(self.floor, admitted) if i not in self.left and i not in present)

    def state(self) -> tuple[int, list[int]]:
        return self.floor, sorted(self.left)
