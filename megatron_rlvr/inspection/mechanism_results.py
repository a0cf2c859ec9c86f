"""The CaSP mechanism study's results folder as the report and its figures read it: the `Design` it records
(``experiment.json``), the probe scores by label (``probe/*.json``) and the eval runs by label (``eval/*.json``),
and each probe statistic of a checkpoint as a `mechanism_stats.Quantity` of the resampled prompts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rlvr.inspection import mechanism_stats as ms
from megatron_rlvr.inspection.mechanism_design import Design
from megatron_rlvr.inspection.probe_summary import load_scores

RARE = "rare"  # the statistic "log-probability per token of the base's rare correct answers"


@dataclass
class Results:
    """What the results folder holds: the design, probe scores by label, eval runs by label."""

    root: Path
    design: Design
    probe: dict[str, dict[str, Any]]
    evals: dict[str, Any]

    @classmethod
    def load(cls, root: str | os.PathLike) -> Results:
        from megatron_rlvr.eval.results import load_run

        root = Path(root)
        spec = (
            json.loads((root / "experiment.json").read_text())["design"] if (root / "experiment.json").is_file() else {}
        )
        design = Design(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
        probe = {p.stem: load_scores(p) for p in sorted((root / "probe").glob("*.json"))}
        evals = {p.stem: load_run(p) for p in sorted((root / "eval").glob("*.json"))}
        digests = {s["probe_set"] for s in probe.values()}
        if len(digests) > 1:
            raise ValueError(f"{root}/probe: scores of {len(digests)} different probe sets; keep one probe set")
        return cls(root, design, probe, evals)

    def quantity(self, label: str, scope: str, name: str) -> ms.Quantity | None:
        scores = self.probe.get(label)
        if scores is None:
            return None
        if name == RARE:
            return ms.rare_logp(scores, per_token=True)
        if name == "rank23":  # the mass of ranks 2 and 3: what CaSP's smoothing keeps
            return ms.difference(ms.statistic(scores, scope, "top3"), ms.statistic(scores, scope, "rank1"))
        return ms.statistic(scores, scope, name)

    @property
    def prompts(self) -> int:
        return len(next(iter(self.probe.values()))["prompts"]) if self.probe else 0
