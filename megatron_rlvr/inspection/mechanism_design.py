"""The CaSP mechanism study's fixed design (docs/casp-mechanism.md): which runs, which checkpoints are probed, what
everything is named. One home for these facts: the driver (tools/experiments/casp_mechanism.py) runs what it lists
and the report (mechanism_report.py) reads what it names, from the same results folder.

Runs are ``<arm>-s<seed>``: GRPO and CaSP in seed pairs (a pair shares its seed, so both arms see the same prompts
and the same first rollouts), PSR and NSR one seed each. Probe scores are ``probe/<run>-step<N>.json`` and
``probe/base.json`` (step 0 of every run); evaluations ``eval/<run>.json`` and ``eval/base.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PAIRED_ARMS = ("grpo", "casp")
SINGLE_ARMS = ("psr", "nsr")
BASE = "base"


@dataclass(frozen=True)
class Design:
    seeds: tuple[int, ...] = (1, 2, 3)  # GRPO / CaSP seed pairs
    single_seed: int = 1  # PSR and NSR: one run each, the first pair's seed
    steps: int = 32
    probe_every: int = 8  # the probe at steps 0, 8, ..., steps
    ks: tuple[int, ...] = (8, 64)  # E[distinct tokens in K draws]; the first is the headline
    pass_ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    eval_problems: int = 128
    eval_samples: int = 32
    probe_prompts: int = 128
    probe_samples: int = 64  # the base's samples per probe prompt (rare answers: 1..4 of them correct)
    probe_keep: int = 2  # probe responses per prompt (the scoring's cost grows with them; the prompts are the unit)
    extra: dict[str, Any] = field(default_factory=dict)  # anything a smaller variant changes (e.g. a smoke run)

    def paired_runs(self) -> list[tuple[int, dict[str, str]]]:
        """[(seed, {arm: run name})] for each seed pair."""
        return [(s, {arm: run_name(arm, s) for arm in PAIRED_ARMS}) for s in self.seeds]

    def runs(self) -> list[tuple[str, int, str]]:
        """(arm, seed, name) of every training run, in the order the driver runs them: the pairs first."""
        out = [(arm, s, run_name(arm, s)) for s in self.seeds for arm in PAIRED_ARMS]
        return out + [(arm, self.single_seed, run_name(arm, self.single_seed)) for arm in SINGLE_ARMS]

    def probe_steps(self) -> list[int]:
        return list(range(0, self.steps + 1, self.probe_every)) if self.probe_every else [0, self.steps]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def probe_label(run: str, step: int) -> str:
    """The scores file of a run's checkpoint at ``step`` (step 0: the base, shared by every run)."""
    return BASE if step == 0 else f"{run}-step{step}"
