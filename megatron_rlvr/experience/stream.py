"""The engine side of fully asynchronous training (``rollout.max_staleness >= 2``, docs/async.md), apart from its
transport (stream_server.py): admit prompts within the staleness bound (admission.py), advance the engine one step
at a time, tag every token with the weight version that sampled it, score each group when its last response ends,
and hand a step the groups the ledger selects.

One `StreamCore` per engine rank. Its ledger is replicated: every rank applies the same events (groups done, in rank
order) and makes the same admissions (the prompt stream, drawn alike on every rank, and the replica with the fewest
groups running), so no rank needs to ask another what to do. A group runs on one replica (rollout DP); only engine
rank 0 (``shipper``) keeps finished groups and builds the steps.

Seeds: the group admitted a-th is sampled with the seed of prompt ``a % N`` of step ``a // N`` in `collect` (refill
round 0, rollout rank 0), so with nothing in flight across an update it samples exactly what the step path samples.
A response continued after a resume takes the seed of refill round ``1 + resumes`` instead.

A checkpoint holds a `StreamState`: the ledger, the finished groups not yet trained, every response in flight
with its tokens, log-probs and versions so far, and the next step's experience when it had already shipped. A resumed
run puts it back and continues each unfinished response from its saved tokens (a new request: prompt + those tokens,
the rest of the budget), so every admitted prompt trains exactly once and the bound holds across the resume.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.experience.admission import Entry, Ledger
from megatron_rlvr.experience.collect import Experience, Group, assemble, group_of, sampling_seed, verify
from megatron_rlvr.experience.group_account import GroupAccount
from megatron_rlvr.experience.wire import Rollout
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout import Completion, PrefixCacheCounts, Progress, Sampling, StreamingEngine, prompt_seed


@dataclass
class Response:
    """A streamed response so far: its tokens, their engine log-probs and the weight version of each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    resumed: bool = False  # continued from a checkpoint's saved tokens

    def completion(self, versions: bool = True) -> Completion:
        return Completion(
            self.token_ids,
            self.logprobs,
            self.text,
            self.finish_reason or "",
            versions=self.versions if versions else None,
        )


@dataclass
class InFlight:
    """A group running on this replica."""

    entry: Entry
    item: PromptItem
    seed: int
    responses: list[Response]
    resumes: int = 0


@dataclass
class Done:
    """A group whose last response ended, scored on its replica: what the other engine ranks learn of it."""

    index: int
    uniform: bool
    group: Group
    counters: dict[str, int]
    resumed: int = 0  # responses continued from a checkpoint's saved tokens


@dataclass
class Report:
    """One rank's news since the last exchange, handed to every rank's `StreamCore.apply`: the groups done, its busy
    seconds, the groups it still runs and the admissions it had made then (for `async/dropped`, group_account.py),
    and its prefix cache's counts."""

    done: list[Done]
    busy_s: float
    running: list[int]
    admitted: int
    prefix_cache: PrefixCacheCounts


@dataclass
class StreamState:
    """What a checkpoint holds of the stream (see the module doc); plain data."""

    version: int
    next_step: int
    admitted: int
    loader: dict[str, Any]
    entries: list[Entry]
    in_flight: list[InFlight]
    finished: list[Group]
    totals: dict[str, int]  # groups that left the ledger so far: trained, filtered (dynamic sampling)
    # the next step's experience, shipped (it left the ledger) and received by the actor before the checkpoint was
    # taken: a resumed run trains it first. Set by the actor's side, never by `StreamCore.state`
    taken: Rollout | None = None
    # the ids of the groups that left (GroupAccount.state); None in checkpoints written before it was kept: every
    # admitted group not in ``entries`` is taken to have left
    left: tuple[int, list[int]] | None = None


class StreamCore:
    """One engine rank's part of the stream (see the module doc)."""

    def __init__(
        self,
        stream: StreamingEngine,
        pool: RewardPool,
        loader: PromptLoader,
        cfg: Config,
        *,
        pad_id: int,
        replica: int,
        replicas: int,
        shipper: bool,
        start_step: int,
        version: int,
    ) -> None:
        self.stream, self.pool, self.loader, self.cfg, self.pad_id = stream, pool, loader, cfg, pad_id
        self.replica, self.replicas, self.shipper, self.version = replica, replicas, shipper, version
        n = cfg.trainer.prompts_per_step
        budget = cfg.rollout.refill_max_rounds * n if cfg.algo.drop_uniform_groups else 0
        self.ledger = Ledger(cfg.rollout.max_staleness, n, start_step, budget)
        self.running: dict[int, InFlight] = {}  # admission index -> group on this replica
        self.finished: dict[int, Group] = {}  # the shipper's finished groups, not yet trained
        self.filtered: list[Group] = []  # the shipper's groups dynamic sampling dropped since the last step
        self.counters: dict[str, int] = {}  # the shipper's reward counters since the last step
        self.resumed: dict[int, int] = {}  # the shipper's finished groups' responses continued after a resume
        self.outbox: list[Done] = []
        self.answers: dict[str, list[Response]] = {}  # "generate" requests (validation, PBA's base evidence)
        self.busy_s = 0.0  # this rank's time in engine steps and scoring since the last exchange
        self.engine_s = 0.0  # the replicas' mean busy time since the last step
        self.last_ship = time.perf_counter()
        self.totals = {"trained": 0, "filtered": 0}  # groups that left the ledger, each way
        self.account = GroupAccount()  # the shipper's: which admitted groups left, by the groups themselves
        self.reported_running: set[int] = set()  # the groups the replicas ran at the last exchange
        self.reported_admitted = 0  # the admissions made by then; later ones cannot have been reported yet
        self.prefix_cache = PrefixCacheCounts()  # the replicas' prefix cache since the last step

    # -- admission and generation

    def sampling(self, max_tokens: int | None = None, min_tokens: int | None = None, seed: int | None = None):
        r = self.cfg.rollout
        return Sampling(
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_new_tokens if max_tokens is None else max_tokens,
            min_tokens=r.min_new_tokens if min_tokens is None else min_tokens,
            stop=list(r.stop),
            seed=seed,
            logprobs=True,
        )

    def group_seed(self, index: int, round_: int = 0) -> int:
        n = self.ledger.per_step
        return prompt_seed(sampling_seed(self.cfg.trainer.seed, index // n, 0, round_), index % n)

    def admit(self) -> int:
        """Start every prompt the bound allows now (the same decisions on every rank); returns how many."""
        count = 0
        while self.ledger.room(self.version):
            item = self.loader.draw(1)[0]
            replica = min(range(self.replicas), key=lambda r: (self.ledger.running(r), r))
            entry = self.ledger.admit(self.version, replica)
            if replica == self.replica:
                seed = self.group_seed(entry.index)
                group = InFlight(entry, item, seed, [Response() for _ in range(self.cfg.rollout.group_size)])
                self.running[entry.index] = group
                self.stream.submit(
                    f"g{entry.index}", list(item.prompt_ids), len(group.responses), self.sampling(seed=seed)
                )
            count += 1
        return count

    def advance(self) -> bool:
        """One engine step of this replica's requests (False: it had none); groups that ended are scored."""
        if not self.stream.in_flight():
            return False
        started = time.perf_counter()
        for news in self.stream.step():
            self._absorb(news)
        self.busy_s += time.perf_counter() - started
        return True

    def _absorb(self, news: Progress) -> None:
        if news.key in self.answers:  # a "generate" request's response
            self._extend(self.answers[news.key][news.index], news, self.version)
            return
        index, _, j = news.key[1:].partition(".")  # "g<index>" (n responses) or "g<index>.<j>" (one, continued)
        group = self.running[int(index)]
        self._extend(group.responses[int(j) if j else news.index], news, self.version)
        if all(r.finish_reason for r in group.responses):
            self._done(self.running.pop(int(index)))

    @staticmethod
    def _extend(response: Response, news: Progress, version: int) -> None:
        response.token_ids += news.token_ids
        response.logprobs += news.logprobs
        response.versions += [version] * len(news.token_ids)
        response.text += news.text
        response.finish_reason = news.finish_reason or response.finish_reason

    def _done(self, flight: InFlight) -> None:
        completions = [r.completion() for r in flight.responses]
        rewards, counters = verify(self.pool, [flight.item], [completions], shared=False)
        group = group_of(0, flight.entry.index, flight.item, completions, rewards, self.cfg)
        resumed = sum(r.resumed for r in flight.responses)
        self.outbox.append(Done(flight.entry.index, group.uniform, group, counters, resumed))

    # -- the replicated ledger

    def events(self) -> Report:
        """This rank's news since the last exchange; handed to every rank's `apply`."""
        out, self.outbox = self.outbox, []
        busy, self.busy_s = self.busy_s, 0.0
        counts = self.stream.take_prefix_cache_counts()
        return Report(out, busy, sorted(self.running), self.ledger.admitted, counts)

    def apply(self, reports: list[Report]) -> None:
        """Every rank's `events`, in rank order: the same ledger changes on every rank."""
        self.engine_s += sum(r.busy_s for r in reports) / len(reports)  # the replicas' mean
        self.reported_running = {i for r in reports for i in r.running}
        self.reported_admitted = min(r.admitted for r in reports)
        for r in reports:
            self.prefix_cache.add(r.prefix_cache)
        for done in (d for r in reports for d in r.done):
            filtered = done.uniform and self.ledger.may_filter()
            if filtered:
                self.ledger.filter(done.index)
                self.totals["filtered"] += 1
            else:
                self.ledger.finish(done.index)
            if not self.shipper:
                continue
            if filtered:
                self.account.leave([done.index], "filtered")
            for key, value in done.counters.items():
                self.counters[key] = self.counters.get(key, 0) + value
            if filtered:
                self.filtered.append(done.group)
            else:
                self.finished[done.index] = done.group
                self.resumed[done.index] = done.resumed

    def idle(self) -> bool:
        """Nothing runs anywhere and nothing may start: only a command can change that (every rank agrees)."""
        return all(e.finished for e in self.ledger.entries.values()) and not self.ledger.room(self.version)

    # -- steps

    def ship(self, step: int) -> Rollout | None:
        """Step ``step``'s experience once the ledger's selection is ready (the shipper's; None elsewhere), or None
        while it must wait. Every rank calls it alike."""
        chosen = self.ledger.select(step)
        if chosen is None:
            return None
        self.ledger.ship(step, chosen)
        self.totals["trained"] += len(chosen)
        now = time.perf_counter()
        wall, engine_s = now - self.last_ship, self.engine_s
        self.last_ship, self.engine_s = now, 0.0
        if not self.shipper:
            return None
        groups = [self.finished.pop(i) for i in chosen]
        self.account.leave([g.index for g in groups], "trained")
        # counted when the group trains, not when it finishes: a continued group due after the run's last step
        # may finish and never train
        resumed = sum(self.resumed.pop(i, 0) for i in chosen)
        counters, self.counters = self.counters, {}
        cache, self.prefix_cache = self.prefix_cache, PrefixCacheCounts()
        exp = assemble(
            groups,
            groups + self.filtered,
            self.cfg,
            pad_id=self.pad_id,
            counters=counters,
            rounds=0,
            refill=self.cfg.algo.drop_uniform_groups,
        )
        self.filtered = []
        staleness, stream_metrics = _staleness(exp, step)
        exp = dataclasses.replace(
            exp,
            staleness=staleness,
            metrics=exp.metrics
            | stream_metrics
            | {
                "async/engine_idle_frac": max(0.0, 1.0 - engine_s / wall) if wall > 0 else 0.0,
                "async/in_flight_groups": float(len(self.ledger.entries)),
                "async/resumed_responses": float(resumed),
                # admitted groups that did not train, were not dropped by dynamic sampling, and neither run on a replica
                # nor wait finished: counted from the groups themselves, not from the ledger (group_account.py)
                "async/dropped": float(self.account.dropped(self.ledger.admitted, self._present())),
                "rollout/prefix_cache_queries": float(cache.queries),
                "rollout/prefix_cache_hits": float(cache.hits),
            },
        )
        return Rollout(step, step - int(exp.staleness.max()), self.loader.state_dict(), exp, engine_s)

    def _present(self) -> set[int]:
        """The groups that are somewhere: running at the last exchange (or admitted since), or finished and held."""
        since = set(range(self.reported_admitted, self.ledger.admitted))
        return self.reported_running | set(self.finished) | since

    # -- requests of the actor's own ("generate": validation, PBA's base evidence)

    def answer(self, requests: list[Any], dp_rank: int) -> list[tuple[int, list[list[Completion]]]]:
        """This replica's share of the requests (prompt ids, n, sampling), answered by the stream while the training
        requests go on; returns (request index, completions) pairs."""
        mine = [(i, r) for i, r in enumerate(requests) if i % self.replicas == dp_rank]
        for i, (prompts, n, sampling) in mine:
            for p, prompt in enumerate(prompts):
                self.answers[f"v{i}.{p}"] = [Response() for _ in range(n)]
                seeded = dataclasses.replace(sampling, seed=prompt_seed(sampling.seed, p))
                self.stream.submit(f"v{i}.{p}", list(prompt), n, seeded)
        while not all(r.finish_reason for responses in self.answers.values() for r in responses):
            self.advance()
        out = [
            (i, [[r.completion(versions=False) for r in self.answers[f"v{i}.{p}"]] for p in range(len(prompts))])
            for i, (prompts, _, _) in mine
        ]
        self.answers.clear()
        return out

    # -- checkpoints

    def local_state(self) -> list[InFlight]:
        return list(self.running.values())

    def state(self, in_flight: list[InFlight]) -> StreamState:
        """The shipper's checkpoint of the stream, given every rank's `local_state`."""
        return StreamState(
            self.version,
            self.ledger.next_step,
            self.ledger.admitted,
            self.loader.state_dict(),
            [dataclasses.replace(e) for e in self.ledger.entries.values()],
            in_flight,
            list(self.finished.values()),
            dict(self.totals),
            left=self.account.state(),
        )

    def restore(self, state: StreamState) -> None:
        """Put a checkpoint's stream back (every rank): the ledger, the finished groups (the shipper's) and the
        responses in flight, each continued from its saved tokens on the replica with the fewest groups running."""
        self.loader.load_state_dict(state.loader)
        self.ledger.next_step, self.ledger.admitted = state.next_step, state.admitted
        self.totals = dict(state.totals)
        if state.left is not None:
            self.account = GroupAccount(state.left[0], state.left[1])
        else:  # a checkpoint from before the account: what is not in its ledger left
            remaining = {e.index for e in state.entries}
            floor = min(remaining, default=state.admitted)
            self.account = GroupAccount(floor, (i for i in range(floor, state.admitted) if i not in remaining))
        flights = {f.entry.index: f for f in state.in_flight}
        for entry in sorted(state.entries, key=lambda e: e.index):
            if not entry.finished:
                entry.replica = min(range(self.replicas), key=lambda r: (self.ledger.running(r), r))
            self.ledger.restore(entry)
            if not entry.finished and entry.replica == self.replica:
                self._continue(flights[entry.index])
        if self.shipper:
            self.finished = {g.index: g for g in state.finished}

    def _continue(self, flight: InFlight) -> None:
        flight.resumes += 1
        self.running[flight.entry.index] = flight
        seed = self.group_seed(flight.entry.index, 1 + flight.resumes)
        r = self.cfg.rollout
        for j, response in enumerate(flight.responses):
            if response.finish_reason:
                continue
            response.resumed = bool(response.token_ids)
            done = len(response.token_ids)
            sampling = self.sampling(r.max_new_tokens - done, max(0, r.min_new_tokens - done), seed + j)
            key = f"g{flight.entry.index}.{j}"
            self.stream.submit(key, list(flight.item.prompt_ids) + response.token_ids, 1, sampling)


def _staleness(exp: Experience, step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Each response's staleness (updates between its oldest token's weights and ``step``) and the staleness and
    weight-version metrics of the responses a step trains."""
    responses = [c for group in exp.completions for c in group]
    oldest = torch.tensor([c.versions[0] if c.versions else step for c in responses], dtype=torch.float32)
    staleness = step - oldest
    mixed = torch.tensor([bool(c.versions) and c.versions[0] != c.versions[-1] for c in responses])
    tokens = torch.tensor([len(c.token_ids) for c in responses], dtype=torch.float32)
    return staleness, {
        "rollout/staleness": float(staleness.mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/mixed_version_frac": float(mixed.float().mean()),  # responses sampled by more than one version
        "rollout/mixed_version_tokens_frac": float((tokens * mixed).sum() / tokens.sum().clamp_min(1)),
    }
