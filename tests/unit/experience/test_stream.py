"""Fully asynchronous training's engine side on one process, with a scripted streaming engine: the admission
ledger's bound holds whatever the lengths (a forced slow group trains exactly at its deadline, never later), nothing
finished is dropped, responses in flight across an update carry two versions, dynamic sampling refills within
admission, and a checkpoint's stream state continues every response in flight from its saved tokens."""

from __future__ import annotations

import random

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.experience.admission import Ledger
from megatron_rlvr.experience.stream import StreamCore
from megatron_rlvr.testing.engines import ScriptedStream

N, G = 4, 2


class Pool:
    def score_batch(self, tasks, responses, references):
        return [1.0 if r == "yes" else 0.0 for r in responses], {"items": len(responses)}


def _cfg(k: int, *extra: str):
    return load_config(
        None,
        [
            f"rollout.max_staleness={k}",
            "rollout.placement=separate",
            "rollout.engine_ranks=1",
            f"rollout.group_size={G}",
            "rollout.max_new_tokens=200",
            f"trainer.prompts_per_step={N}",
            *extra,
        ],
    )


def _items(count: int = 200) -> list[PromptItem]:
    return [PromptItem(f"p{i}", "", (i % 50 + 1, 9), "yes", "scripted") for i in range(count)]


def _core(cfg, stream, *, start_step=0, loader=None):
    loader = loader or PromptLoader(_items(), N, seed=0, shuffle=False)
    return StreamCore(
        stream,
        Pool(),
        loader,
        cfg,
        pad_id=0,
        replica=0,
        replicas=1,
        shipper=True,
        start_step=start_step,
        version=start_step,
    )


def _tick(core):
    core.apply([core.events()])
    core.admit()
    core.advance()


def _train(core, steps: range, update_ticks: int):
    """The trainer: take each step (the engine runs until it is ready), then ``update_ticks`` engine steps while the
    update runs, then the new weights go in. Returns the rollouts and the engine steps each take waited."""
    rollouts, waits = [], []
    for step in steps:
        waited = 0
        while True:
            core.apply([core.events()])
            if (rollout := core.ship(step)) is not None:
                break
            core.admit()
            assert core.advance() or not core.idle(), "stuck: nothing runs, nothing may start, step not ready"
            waited += 1
            assert waited < 10_000
        rollouts.append(rollout)
        waits.append(waited)
        for _ in range(update_ticks):
            _tick(core)
        core.version = step + 1
    return rollouts, waits


def _check_bound(rollouts, k):
    for r in rollouts:
        for group in r.experience.completions:
            for c in group:
                assert len(c.versions) == len(c.token_ids) and c.versions == sorted(c.versions)
                assert r.step - c.versions[0] <= k, (r.step, c.versions)
        assert float(r.experience.staleness.max()) <= k


@pytest.mark.parametrize("k", [2, 4])
def test_a_forced_slow_group_trains_at_its_deadline_never_later(k):
    slow = 1  # the second prompt admitted: 80 tokens, every other response 3
    stream = ScriptedStream(lambda key, j, prompt: 80 if key == f"g{slow}" else 3)
    core = _core(_cfg(k), stream)
    rollouts, waits = _train(core, range(8), update_ticks=2)
    _check_bound(rollouts, k)
    trained_at = {g.index: r.step for r in rollouts for g in _groups(r)}
    assert trained_at[slow] == k  # admitted with version 0: due at step k, and the step waited for it
    assert waits[k] > max(waits[:k])  # that step's take waited for the slow group (the trainer idles)
    slow_group = next(g for r in rollouts for g in _groups(r) if g.index == slow)
    assert all(c.versions[0] == 0 and c.versions[-1] > 0 for c in slow_group.completions)  # sampled by 2+ versions
    _check_accounting(core, rollouts)


def _groups(rollout):
    """The groups a rollout trains (their admission indices come back through the items' order)."""
    from types import SimpleNamespace

    exp = rollout.experience
    return [SimpleNamespace(index=int(item.id[1:]), completions=c) for item, c in zip(exp.items, exp.completions)]


def _check_accounting(core, rollouts):
    trained = [g.index for r in rollouts for g in _groups(r)]
    assert len(trained) == len(set(trained)) == N * len(rollouts)  # each group trains once
    waiting = set(core.ledger.entries)
    assert set(trained).isdisjoint(waiting)
    assert set(range(core.ledger.admitted)) == set(trained) | waiting  # nothing dropped (no filtering here)
    assert all(r.experience.metrics["async/dropped"] == 0 for r in rollouts)


@pytest.mark.parametrize("seed", range(12))
def test_random_long_tailed_lengths_keep_the_bound_and_drop_nothing(seed):
    rng = random.Random(seed)
    lengths: dict[str, int] = {}
    k = rng.choice([2, 3, 4])

    def length(key, j, prompt):
        return lengths.setdefault(f"{key}/{j}", max(1, int(rng.lognormvariate(1.5, 1.0))))

    core = _core(_cfg(k), ScriptedStream(length))
    rollouts, _ = _train(core, range(10), update_ticks=rng.randint(0, 6))
    _check_bound(rollouts, k)
    _check_accounting(core, rollouts)
    mixed = [r.experience.metrics["rollout/mixed_version_frac"] for r in rollouts]
    assert all(0 <= m <= 1 for m in mixed)


def test_admission_room_is_k_plus_one_steps_then_k_while_the_sync_is_pending():
    ledger = Ledger(k=2, per_step=4, next_step=5)
    assert ledger.room(version=5) == 12 and ledger.room(version=4) == 8
    for _ in range(8):
        ledger.admit(version=4, replica=0)
    assert ledger.room(version=4) == 0 and ledger.room(version=5) == 4
    assert ledger.select(5) is None  # nothing finished yet
    with pytest.raises(RuntimeError, match="step 6 asked, step 5 is next"):
        ledger.select(6)


def test_dynamic_sampling_refills_within_admission_and_counts_what_it_drops():
    # prompts with an even first id are answered "yes" by both samples: uniform groups, dropped and refilled
    cfg = _cfg(2, "algo.drop_uniform_groups=true", "rollout.refill_max_rounds=1")
    text = lambda key, j, prompt: "yes" if prompt[0] % 2 == 0 or j == 0 else "no"  # noqa: E731
    core = _core(cfg, ScriptedStream(lambda key, j, prompt: 2 + int(key[1:].split(".")[0]) % 3, text))
    rollouts, _ = _train(core, range(6), update_ticks=1)
    _check_bound(rollouts, 2)
    for r in rollouts:
        m, rewards = r.experience.metrics, r.experience.rollouts.rewards.view(N, G)
        uniform_trained = int((rewards == rewards[:, :1]).all(dim=1).sum())  # past the budget: trained, masked
        assert m["batch/uniform_groups_dropped"] - uniform_trained <= N  # at most refill_max_rounds * N filtered
        assert m["batch/groups_trained"] == N - uniform_trained
        assert m["async/dropped"] == 0
    filtered = core.totals["filtered"]
    trained = [g.index for r in rollouts for g in _groups(r)]
    assert filtered > 0 and len(set(trained)) == len(trained)
    assert core.ledger.admitted == len(trained) + filtered + len(core.ledger.entries)


def test_a_checkpoint_continues_every_response_in_flight_from_its_saved_tokens():
    lengths = {}

    def length(key, j, prompt):
        index, _, alone = key[1:].partition(".")  # "g<index>.<j>": response j, continued alone
        index, j = int(index), int(alone) if alone else j
        total = lengths.setdefault((index, j), 3 + (index * 7 + j * 5) % 13)
        return total - (len(prompt) - 2)  # a continuation's prompt holds the saved tokens already

    cfg = _cfg(2)
    core = _core(cfg, ScriptedStream(length))
    first, _ = _train(core, range(3), update_ticks=2)
    for _ in range(3):  # some responses are half-way now
        _tick(core)
    state = core.state(core.local_state())
    partial = {(f.entry.index, j): r.token_ids[:] for f in state.in_flight for j, r in enumerate(f.responses)}
    assert any(0 < len(t) < lengths[key] for key, t in partial.items())

    stream = ScriptedStream(length)
    resumed = _core(cfg, stream, start_step=3, loader=PromptLoader(_items(), N, seed=0, shuffle=False))
    resumed.restore(state)
    # every unfinished response goes on alone from its saved tokens: "g<index>.<j>", the prompt plus those tokens
    assert stream.submitted and all("." in key and n == 1 for key, _, n, _ in stream.submitted)
    for key, prompt, _, sampling in stream.submitted:
        index, j = map(int, key[1:].split("."))
        assert prompt[2:] == partial[(index, j)] and sampling.max_tokens == 200 - len(partial[(index, j)])
    second, _ = _train(resumed, range(3, 7), update_ticks=2)
    rollouts = first + second
    _check_bound(rollouts, 2)
    trained = [g.index for r in rollouts for g in _groups(r)]
    assert len(trained) == len(set(trained)) == N * 7
    assert set(range(resumed.ledger.admitted)) == set(trained) | set(resumed.ledger.entries)
    continued = 0
    for r in second:
        for g in _groups(r):
            for j, c in enumerate(g.completions):
                saved = partial.get((g.index, j))
                if saved is not None:
                    assert c.token_ids[: len(saved)] == saved and len(c.token_ids) == lengths[(g.index, j)]
                    continued += 0 < len(saved) < lengths[(g.index, j)]
    assert continued > 0
    assert sum(r.experience.metrics["async/resumed_responses"] for r in second) == continued
    assert all(r.experience.metrics["async/dropped"] == 0 for r in rollouts)  # the accounting survives the resume


def test_a_group_lost_on_the_way_counts_as_dropped():
    """``async/dropped`` counts the groups themselves (trained, filtered, running, finished), not the ledger: a
    group whose report never reaches the ledger (a lost message) is 1 there, while the ledger's own arithmetic
    (admitted - trained - filtered - waiting) still balances to 0."""
    core = _core(_cfg(2), ScriptedStream(lambda key, j, prompt: 3))
    rollouts, _ = _train(core, range(2), update_ticks=1)
    assert all(r.experience.metrics["async/dropped"] == 0 for r in rollouts)
    lost = None
    while lost is None:  # run until some group finishes; its report is lost on the way to the ledger
        core.admit()
        core.advance()
        report = core.events()
        if report.done:
            lost = report.done.pop(0).index
        core.apply([report])
    rollout, ticks = None, 0
    while rollout is None:
        core.apply([core.events()])
        rollout = core.ship(2)
        core.admit()
        core.advance()
        ticks += 1
        assert ticks < 1000, "step 2 waits for the lost group: it was due by then"
    assert lost not in {g.index for g in _groups(rollout)}
    ledger = core.ledger
    assert ledger.admitted - core.totals["trained"] - core.totals["filtered"] - len(ledger.entries) == 0
    assert rollout.experience.metrics["async/dropped"] == 1
