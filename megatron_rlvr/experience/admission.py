"""Bounded staleness by admission (fully asynchronous training, docs/async.md): which prompts the engines may start,
and which finished groups a step trains, so that no response ever trains more than ``k`` updates after the weights
that sampled its oldest token, and nothing finished is thrown away for being late.

Versions and steps share one count: the engines hold weights of version v after v updates, and step s trains with
the weights of version s. A group admitted while the engines hold version v has its oldest token from version >= v,
so its *deadline* is v + k: it must train at a step <= v + k. Every step trains N groups (``trainer.prompts_per_step``).

- **Admission.** With the trainer's next step ``s`` and the engines at version v, a group may start only when the
  groups not yet trained (running or finished) stay trainable in time: ``unconsumed + 1 <= (v + k - s + 1) * N``.
  New groups carry the latest deadline, so this is the whole check (below it, earliest-deadline-first order keeps
  every deadline).
- **Selection** (earliest deadline first). Step s takes the N finished groups of earliest deadline (then admission
  order), but only if the groups left behind can still meet theirs: for every deadline d >= s, at most (d - s) * N of
  them may be due by d. Otherwise the step waits for more groups to finish; a group due at s is always in the step.
  That wait is what bounded staleness costs, and the engines keep generating meanwhile.
- **Dynamic sampling** (``algo.drop_uniform_groups``): a finished group whose rewards are all equal is *filtered*
  (it carries no signal; counted as ``batch/uniform_groups_dropped``): it leaves the ledger and frees its place, so
  the engines admit another prompt in its stead: a refill counts against admission exactly like the group it
  replaces. At most ``rollout.refill_max_rounds * N`` groups are filtered per step (today's bound on refill draws);
  past that a uniform group is trained, its tokens masked by a zero advantage, as a short step is padded today.

The ledger is plain data, identical on every engine rank (each applies the same events in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Entry:
    index: int  # admission order (the prompt stream's order)
    version: int  # the engines' weights when it was admitted
    deadline: int  # the last step that may train it
    replica: int  # the engine replica that samples it
    finished: bool = False


class Ledger:
    """The groups admitted and not yet trained; see the module doc. ``k``: rollout.max_staleness, ``per_step``: N."""

    def __init__(self, k: int, per_step: int, next_step: int, refill_budget: int = 0) -> None:
        if k < 0 or per_step < 1:
            raise ValueError(f"Ledger: expected k >= 0 and per_step >= 1, got k={k}, per_step={per_step}")
        self.k, self.per_step, self.next_step = k, per_step, next_step
        self.refill_budget = refill_budget  # groups that may be filtered per step
        self.entries: dict[int, Entry] = {}
        self.admitted = 0  # the next admission index
        self.filtered_since_ship = 0

    def room(self, version: int) -> int:
        """Groups that may start now with the engines at ``version``."""
        bound = (version + self.k - self.next_step + 1) * self.per_step
        return max(0, bound - len(self.entries))

    def admit(self, version: int, replica: int) -> Entry:
        if self.room(version) < 1:
            raise RuntimeError(f"Ledger.admit: no room at version {version} for step {self.next_step}")
        entry = Entry(self.admitted, version, version + self.k, replica)
        self.entries[entry.index] = entry
        self.admitted += 1
        return entry

    def restore(self, entry: Entry) -> None:
        """Put back an entry a checkpoint held (the resumed run's ledger starts from the checkpoint's)."""
        self.entries[entry.index] = entry
        self.admitted = max(self.admitted, entry.index + 1)

    def finish(self, index: int) -> None:
        self.entries[index].finished = True

    def may_filter(self) -> bool:
        return self.filtered_since_ship < self.refill_budget

    def filter(self, index: int) -> None:
        """A finished uniform group leaves without training (dynamic sampling); its place is free again."""
        del self.entries[index]
        self.filtered_since_ship += 1

    def running(self, replica: int) -> int:
        return sum(not e.finished and e.replica == replica for e in self.entries.values())

    def select(self, step: int) -> list[int] | None:
        """The admission indices step ``step`` trains, in admission order, or None while it must wait."""
        if step != self.next_step:
            raise RuntimeError(f"Ledger.select: step {step} asked, step {self.next_step} is next")
        order = sorted(self.entries.values(), key=lambda e: (e.deadline, e.index))
        chosen = [e for e in order if e.finished][: self.per_step]
        if len(chosen) < self.per_step:
            return None
        taken = {e.index for e in chosen}
        left = sorted(e.deadline for e in order if e.index not in taken)
        for count, deadline in enumerate(left, start=1):  # groups left behind that are due by `deadline`
            if count > (deadline - step) * self.per_step:
                return None
        return sorted(taken)

    def ship(self, step: int, indices: list[int]) -> list[Entry]:
        """Step ``step`` trains ``indices`` (from `select`): they leave; the next step is ``step + 1``."""
        shipped = [self.entries.pop(i) for i in indices]
        late = [e.index for e in shipped if step > e.deadline]
        if late:  # cannot happen by construction; a bug must not train silently past the bound
            raise RuntimeError(f"Ledger.ship: groups {late} would train at step {step}, past their deadline")
        self.next_step = step + 1
        self.filtered_since_ship = 0
        return shipped
