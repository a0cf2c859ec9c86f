"""PBA's base evidence: how many of M base-model samples per training prompt are correct (docs/algorithms.md, "PBA").

`base_evidence(engine, pool, items, cfg, path, run_seed=...)` draws ``M = algo.kl.pba.base_samples`` samples per
prompt from the engine's current weights (the caller runs it before the first update, so they are the base's),
scores them with the reward pool (correct: reward >= 1, as pass@k counts) and stores ``prompt id -> count`` in
``path`` (JSON). The draw goes in chunks of prompts (``chunk_samples`` samples per chunk); each chunk is sampled like
one rollout step (experience/collect.py `generate`: rollout ranks share its prompts, seeds from the run seed, the
chunk's index and the rollout rank, at the rollout's temperature, top-p, budget and stop strings), so the counts are a
function of the run seed and the prompt list. Rank 0 rewrites the file atomically after every chunk: an interrupted draw
resumes at its first incomplete chunk, and a rerun whose file holds every prompt draws nothing.

The file records M, the base model (``model.hf_dir`` and ``model.load``), the run seed and the sampling settings; a
file written under other ones is rejected (its counts would be another experiment's evidence). A `PrefixedEngine`
is unwrapped: the evidence is the base model's own samples, without weak prefixes.

`BaseAnchoring` (the transform registered as ``pba``) turns the evidence into what each step's experience carries:
per-response KL coefficients (its `Targets.kl_coef`) and the pba/* metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rlvr.algos.pba import pba_metrics, sequence_kl_coef
from megatron_rlvr.errors import ConfigError, UserError
from megatron_rlvr.experience.collect import Experience, generate, verify
from megatron_rlvr.experience.transforms import ExperienceTransform, TransformSetup, experience_transform
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout.prefixes import without_prefixes

if TYPE_CHECKING:
    from megatron_rlvr.config import Config
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.rollout import RolloutEngine

FORMAT = 1
# sampling_seed's step for the base draw: training steps are >= 0, validation uses -1 (validation.py)
BASE_EVIDENCE_STEP = -2


class BaseEvidenceError(UserError, ValueError):
    """A stored base-evidence file does not belong to this run (other M, base model, seed or sampling) or is
    unreadable; the message names the file and the differences."""


def base_evidence(
    engine: RolloutEngine,
    pool: RewardPool,
    items: list[PromptItem],
    cfg: Config,
    path: Path,
    *,
    run_seed: int,
    chunk_samples: int = 4096,
) -> dict[str, int]:
    """prompt id -> correct answers among cfg.algo.kl.pba.base_samples samples of the engine's current (base) weights.
    Reads ``path`` when it holds every item's count (a rerun draws nothing); otherwise generates the missing chunks
    (ranks share the work like collect.generate), rank 0 writes ``path`` atomically. A collective over all
    ranks (all of them read the same file and take the same branch)."""
    path = Path(path)
    m = cfg.algo.kl.pba.base_samples
    header = _header(cfg, run_seed)
    counts = _read(path, header)
    ids = list(dict.fromkeys(item.id for item in items))  # first occurrence: the chunks' fixed layout
    if all(i in counts for i in ids):
        return {i: counts[i] for i in ids}
    engine = without_prefixes(engine)
    first = {}
    for item in items:
        first.setdefault(item.id, item)
    unique = [first[i] for i in ids]
    rollout = dataclasses.replace(cfg.rollout, group_size=m)
    per_chunk = max(1, chunk_samples // m)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for chunk, start in enumerate(range(0, len(unique), per_chunk)):
        part = unique[start : start + per_chunk]
        if all(item.id in counts for item in part):
            continue  # drawn before an interruption: the same seeds would draw the same samples
        completions = generate(engine, part, rollout, run_seed=run_seed, step=BASE_EVIDENCE_STEP, refill_round=chunk)
        rewards, _ = verify(pool, part, completions)
        correct = (rewards.view(len(part), m) >= 1.0).sum(-1).tolist()
        counts.update({item.id: int(c) for item, c in zip(part, correct)})
        if rank0:
            _write(path, header, counts)
    if dist.is_initialized():
        dist.barrier()  # the file is complete before any rank goes on (and may read it again)
    return {i: counts[i] for i in ids}


def _header(cfg: Config, run_seed: int) -> dict[str, Any]:
    r = cfg.rollout
    return {
        "format": FORMAT,
        "samples": cfg.algo.kl.pba.base_samples,
        "model": str(cfg.model.hf_dir),
        "load": cfg.model.load,
        "seed": run_seed,
        "sampling": {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_new_tokens": r.max_new_tokens,
            "stop": list(r.stop),
        },
    }


def _read(path: Path, header: dict[str, Any]) -> dict[str, int]:
    """The counts a matching file holds (empty when there is none); a file of another run is an error."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        stored = {key: data[key] for key in header}
        counts = {str(k): int(v) for k, v in data["counts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BaseEvidenceError(
            f"base evidence file {path}: unreadable ({type(e).__name__}: {e}); delete it to draw the base samples again"
        ) from None
    if stored != header:
        differ = "; ".join(
            f"{key}: file {stored[key]!r}, run {header[key]!r}" for key in header if stored[key] != header[key]
        )
        raise BaseEvidenceError(
            f"base evidence file {path} was drawn for another setting ({differ}); use another "
            "trainer.output_dir, or delete the file to draw the base samples again"
        )
    bad = {k: v for k, v in counts.items() if not 0 <= v <= header["samples"]}
    if bad:
        raise BaseEvidenceError(
            f"base evidence file {path}: counts outside [0, {header['samples']}]: {list(bad.items())[:5]}"
        )
    return counts


def _write(path: Path, header: dict[str, Any], counts: dict[str, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(header | {"counts": counts}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never a half-written one


@experience_transform("pba", enabled=lambda cfg: cfg.algo.kl.pba.enabled, stage="targets")
def build(setup: TransformSetup) -> BaseAnchoring:
    return BaseAnchoring(
        setup.cfg,
        setup.engine,
        setup.pool,
        list(setup.prompts),
        setup.output_dir / "base_evidence.json",
        setup.start_step,
    )


class BaseAnchoring(ExperienceTransform):
    """PBA: the frozen base's correct counts per training prompt (drawn when built, before the first update, or
    read back from ``path``); each step's experience gets its per-response KL coefficients and the pba/* metrics."""

    def __init__(
        self,
        cfg: Config,
        engine: RolloutEngine,
        pool: RewardPool,
        items: list[PromptItem],
        path: Path,
        start_step: int,
    ) -> None:
        if start_step > 0 and not path.is_file():  # the engine now holds trained weights: they are not the base
            raise ConfigError(
                f"algo.kl.pba.enabled: resuming at step {start_step} but {path} (the base's evidence) is missing; "
                "start the run afresh or restore the file"
            )
        self.cfg = cfg
        # colocated: this rank's engine; separate: the engine ranks, which hold the initial weights (version 0) here
        self.evidence = base_evidence(engine, pool, items, cfg, path, run_seed=cfg.trainer.seed)

    def __call__(self, step: int, experience: Experience) -> Experience:
        correct = torch.tensor([self.evidence[item.id] for item in experience.items])
        coef = sequence_kl_coef(correct, self.cfg.rollout.group_size, self.cfg.algo)
        return dataclasses.replace(
            experience,
            targets=dataclasses.replace(experience.targets, kl_coef=coef),
            metrics=experience.metrics | pba_metrics(correct, self.cfg.algo),
        )
