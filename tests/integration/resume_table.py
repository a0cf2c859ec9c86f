"""The table of "a resumed run equals an uninterrupted one": each scenario names its uninterrupted reference run, the
step it is interrupted after and how, and the metrics the resumed steps must repeat exactly (relative 1e-6).

Runs are shared. `Runs` (one per test module, on the session's `workers2`) trains each reference once, with a
periodic checkpoint at the interruption's step; a scenario resumed from that checkpoint needs one more run (the
steps after it), a signalled one two (the run the signal stops, then the rerun). Scenarios that resume the same
configuration share its reference (plain and preempted), and a module's other tests read the same references
(exports, checkpoint contents, per-step metrics). The rows are split over two test files (tests/integration/test_resume.py,
tests/integration/test_resume_layouts.py) by reference: nothing is shared across files, so xdist may run them side by side.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.training_runs import COMPARED, train

if TYPE_CHECKING:
    from megatron_rlvr.testing.workers import WorkerGroup
    from megatron_rlvr.trainer import Parts

STEPS = 4  # every reference runs 4 steps


def _rewards_one_in_2() -> Parts:
    """Scripted rewards, about half the responses correct: most prompts find a correct anchor among 4 candidates and
    most groups of 3 policy samples are not uniform (ARMOR)."""
    from megatron_rlvr.testing.loop_fakes import one_in, scripted_rewards
    from megatron_rlvr.trainer import Parts

    return Parts(rewards=scripted_rewards(one_in(2)))


def _rewards_one_in_8() -> Parts:
    """Scripted rewards, one response in 8 correct: about 60% of the groups of 4 are uniform, so dynamic sampling
    refills most steps."""
    from megatron_rlvr.testing.loop_fakes import one_in, scripted_rewards
    from megatron_rlvr.trainer import Parts

    return Parts(rewards=scripted_rewards(one_in(8)))


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run of `STEPS` steps, with a checkpoint every ``save_every`` steps."""

    overrides: tuple[str, ...] = ()
    save_every: int = 2
    tp: int = 2
    parts: Callable[[], Parts] | None = None  # the loop's replaced components (an importable function): the rewards
    # each run in a worker group of its own: separate placement splits the world and pins each rank's cores for good
    own_workers: bool = False


REFERENCES = {
    "plain": Reference(),
    # dynamic sampling's refill rounds and the rollout correction (tis) read from the engine's log-probs
    "refill": Reference(
        ("algo.drop_uniform_groups=true", "rollout.refill_max_rounds=2", "algo.rollout_correction.kind=tis"),
        parts=_rewards_one_in_8,
    ),
    # references reset at steps 0 and 2: a checkpoint at step 3 is mid-interval
    "armor": Reference(
        ("algo.loss.kind=grpo", "algo.armor.anchors=true", "algo.armor.reset_every=2"),
        save_every=3,
        parts=_rewards_one_in_2,
    ),
    # the engines serve the adapter alone; the KL term against the free reference (the base)
    "lora": Reference(("actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.sync=adapters", "algo.kl.coef=0.1")),
    "cp": Reference(("actor.cp=2", "algo.kl.coef=0.1", "actor.max_tokens_per_micro_batch=32"), tp=1),
    # one-step-off: rank 1 serves the engine and samples step t+1 while rank 0 (the actor) runs update t
    "one_step_off": Reference(
        (
            "rollout.placement=separate",
            "rollout.engine_ranks=1",
            "rollout.max_staleness=1",
            "algo.rollout_correction.kind=tis",
        ),
        tp=1,
        own_workers=True,
    ),
}


@dataclass(frozen=True)
class Scenario:
    """Resume ``reference`` after step ``after``: from its own periodic checkpoint ("checkpoint"), or from the one a
    SIGTERM during step ``after`` (rank 1, mid-rollout) leaves in a run that then stops ("signal"). The resumed
    steps must repeat the reference's ``compared`` metrics."""

    reference: str
    after: int
    interruption: str = "checkpoint"
    compared: tuple[str, ...] = COMPARED
    run_dir_travels: bool = False  # the resume needs the run directory's files besides the checkpoint (copied)
    why: str = ""


SCENARIOS = {
    "plain": Scenario("plain", 2, why="weights, optimizer, data position, RNG, rollouts"),
    "preempted": Scenario("plain", 2, "signal", why="the stop's checkpoint: every rank finished step 2, then stopped"),
    "refill": Scenario(
        "refill",
        2,
        compared=(
            *COMPARED,
            "batch/refill_rounds",
            "batch/groups_trained",
            "batch/uniform_groups_dropped",
            "response/tokens_trained",
            "rollout_correction/weight_mean",
        ),
        why="the extra prompts drawn and sampled (the loader's stream position), tis on the resumed rollouts",
    ),
    "armor": Scenario(
        "armor",
        3,
        compared=(*COMPARED, "loss/kl_ref", "anchor/groups_trained", "anchor/found_frac", "response/tokens_trained"),
        run_dir_travels=True,  # the interval's anchors file
        why="the reset reference comes back from the checkpoint, the interval's anchors from their file",
    ),
    "lora": Scenario("lora", 2, compared=(*COMPARED, "loss/kl_ref"), why="the adapters and their optimizer state"),
    "cp": Scenario("cp", 2, compared=(*COMPARED, "loss/kl_ref", "actor/cp_padding"), why="CP=2's sharded sequences"),
    "one_step_off": Scenario(
        "one_step_off",
        2,
        compared=(*COMPARED, "rollout/staleness", "rollout/logp_mismatch", "rollout_correction/weight_mean"),
        why="the rollout sampled ahead comes back from the checkpoint (pending_rollout), one update stale",
    ),
}


def _signalled(hf_dir: str, out_dir: str, tp: int, steps: int, extra: list[str], signal_during: int):
    """train, with rank 1 sent SIGTERM during step ``signal_during`` (1-based; its rollout)."""
    from megatron_rlvr.testing.loop_fakes import signalled_during
    from megatron_rlvr.trainer import Parts

    parts = Parts(collect=signalled_during(signal_during - 1, rank=1))
    return train(hf_dir, out_dir, tp, 1, steps, extra, lambda: parts)


@dataclass
class Stop:
    """What a signalled run returned on each rank and left behind before the rerun."""

    histories: list[list[dict]]
    checkpoints: list[str]  # the names under checkpoints/
    verified: bool  # the stop's checkpoint passes `megatron-rlvr ckpt verify`
    exported: bool  # the final HF export exists


@dataclass
class Resumed:
    """A scenario's run directory, its stop (signal), and the resumed run's metrics (rank 0's)."""

    out: Path
    stop: Stop | None
    history: list[dict]


class Runs:
    """Each reference trained once, each scenario resumed once, in ``workers``; every test of a module reads them."""

    def __init__(self, workers: WorkerGroup, hf_dir: str, root: Path) -> None:
        self.workers, self.hf_dir, self.root = workers, hf_dir, root
        self._references: dict[str, list[list[dict]]] = {}
        self._resumed: dict[str, Resumed] = {}

    def _run(self, ref: Reference, fn: Callable, *args) -> list:
        """``fn(*args)`` on the module's group, or on a group of its own for a reference that needs one."""
        if not ref.own_workers:
            return self.workers.run(fn, *args, timeout_s=900)
        from megatron_rlvr.testing.workers import WorkerGroup

        with WorkerGroup(self.workers.world_size, timeout_s=900) as group:
            return group.run(fn, *args)

    def reference_dir(self, name: str) -> Path:
        return self.root / f"reference-{name}"

    def reference(self, name: str) -> list[list[dict]]:
        """Every rank's metrics of reference ``name``'s uninterrupted run."""
        if name not in self._references:
            ref = REFERENCES[name]
            saving = [f"checkpoint.save_every={ref.save_every}"]
            out = str(self.reference_dir(name))
            self._references[name] = self._run(
                ref, train, self.hf_dir, out, ref.tp, 1, STEPS, [*ref.overrides, *saving], ref.parts
            )
        return self._references[name]

    def resumed(self, name: str) -> Resumed:
        if name not in self._resumed:
            self._resumed[name] = self._resume(name, SCENARIOS[name])
        return self._resumed[name]

    def _resume(self, name: str, scenario: Scenario) -> Resumed:
        ref, out = REFERENCES[scenario.reference], self.root / f"resumed-{name}"
        stop = None
        if scenario.interruption == "signal":  # the run the signal stops, then the same command again
            from megatron_rlvr.checkpoint.manifest import verify

            extra = list(ref.overrides)  # checkpoint.save_every is 0: the stop writes the only checkpoint
            histories = self._run(ref, _signalled, self.hf_dir, str(out), ref.tp, STEPS, extra, scenario.after)
            root = out / "checkpoints"
            saved = root / f"step-{scenario.after:06d}"
            names = sorted(p.name for p in root.iterdir())
            stop = Stop(histories, names, saved.is_dir() and verify(saved).ok, (out / "hf").exists())
        else:
            saved = self.reference_dir(scenario.reference) / "checkpoints" / f"step-{scenario.after:06d}"
            if scenario.run_dir_travels:
                shutil.copytree(self.reference_dir(scenario.reference), out)
                saved = out / "checkpoints" / saved.name
            extra = [*ref.overrides, f"checkpoint.save_every={ref.save_every}", f"checkpoint.resume={saved}"]
        history = self._run(ref, train, self.hf_dir, str(out), ref.tp, 1, STEPS, extra, ref.parts)[0]
        return Resumed(out, stop, history)


def assert_resumed_equals_uninterrupted(runs: Runs, name: str) -> None:
    scenario = SCENARIOS[name]
    full = runs.reference(scenario.reference)[0]
    resumed = runs.resumed(name).history
    assert [m["step"] for m in resumed] == list(range(scenario.after + 1, STEPS + 1))
    for got, want in zip(resumed, full[scenario.after :]):
        for key in scenario.compared:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (name, got["step"], key)
