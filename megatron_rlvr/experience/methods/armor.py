"""ARMOR's anchor rollout (docs/algorithms.md, "ARMOR"): each group is G - 1 policy samples plus one anchor, a
correct sample of the reference pi_ref.

The reference is reset to the policy every ``algo.armor.reset_every`` (beta) steps. Right after a reset the
colocated engine holds exactly the reference's weights (the policy's, synced after the last update), so
`AnchorRollout.prepare` draws the anchors of the whole interval there and then: for each prompt of the next beta steps
(read ahead from the loader, whose order is a pure function of the seed: the prompts each step will draw)
``algo.armor.candidates`` samples, scored by the reward pool; the first correct one (reward >= 1) is the prompt's
anchor. No second engine and no second weight sync: the cost is ``anchor_candidates`` samples per trained prompt,
drawn in one go per interval (one chunk per step, seeded like a rollout round with step ``ANCHOR_STEP - r``).

Rank 0 stores each interval's anchors in ``<output_dir>/anchors/reset_<r>.pt``; a resumed run reads them back (the
engine no longer holds that reference), and the reset reference itself is in the checkpoint (the actor's
``reference{i}``), so resume is exact.

The transform (registered as ``armor``: `AnchorRollout.before` runs ``prepare``, calling it runs ``attach``) reserves
one sample of each group: the source samples ``rollout.group_size - 1`` per prompt. `AnchorRollout.attach` turns a
step's experience (G - 1 policy samples per prompt) into G per group: the anchor goes last, the rewards (overlong
penalty included) and advantages are recomputed over the G responses, and the paper's prompt filter masks out every
response of a group whose policy rewards are all equal or that has no correct anchor. An anchor is a positive sample
only: where its advantage is not > 0 (a group with partial credit or an overlong penalty), its tokens are masked out.
Metrics: ``anchor/groups_trained``, ``anchor/dropped_no_anchor``, ``anchor/dropped_uniform``, ``anchor/found_frac``,
``anchor/reference_pass_rate`` (correct share of the reference's candidates), ``anchor/reset`` (1 on reset steps).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rlvr.algos import compute_advantages
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.collect import Experience, generate, group_of, to_rollouts, untruncated, verify
from megatron_rlvr.experience.transforms import ExperienceTransform, TransformSetup, experience_transform
from megatron_rlvr.protocols.handoffs import Targets
from megatron_rlvr.rewards import RewardPool
from megatron_rlvr.rollout.prefixes import without_prefixes

if TYPE_CHECKING:
    from megatron_rlvr.config import Config
    from megatron_rlvr.data import PromptLoader
    from megatron_rlvr.rollout import Completion, RolloutEngine

FORMAT = 1
# sampling_seed's step for the anchors of the interval starting at step r is ANCHOR_STEP - r (training steps are
# >= 0, validation -1, PBA's base evidence -2)
ANCHOR_STEP = -3


@dataclasses.dataclass
class Interval:
    """The anchors of steps ``start`` .. ``start + len(steps) - 1``: per step, per prompt, (id, anchor or None, the
    anchor's reward)."""

    start: int
    steps: list[list[tuple[str, Completion | None, float]]]
    candidates_correct: int
    candidates_drawn: int


@experience_transform("armor", enabled=lambda cfg: cfg.algo.armor.anchors, reserved_samples=1)
def build(setup: TransformSetup) -> AnchorRollout:
    return AnchorRollout(
        setup.cfg,
        setup.engine,
        setup.pool,
        setup.loader,
        setup.actor.reset_reference,
        setup.output_dir / "anchors",
        pad_id=setup.pad_id,
    )


class AnchorRollout(ExperienceTransform):
    """The reference's anchors for each step (see the module doc); ``reset`` sets the actor's reference to its
    policy."""

    def __init__(
        self,
        cfg: Config,
        engine: RolloutEngine,
        pool: RewardPool,
        loader: PromptLoader,
        reset: Callable[[], None],
        directory: Path,
        *,
        pad_id: int,
    ) -> None:
        self.cfg, self.engine, self.pool, self.loader, self.reset = cfg, engine, pool, loader, reset
        self.directory, self.pad_id = Path(directory), pad_id
        self.interval: Interval | None = None

    def path(self, start: int) -> Path:
        return self.directory / f"reset_{start}.pt"

    def before(self, step: int) -> dict[str, float]:
        return self.prepare(step)

    def __call__(self, step: int, experience: Experience) -> Experience:
        return self.attach(step, experience)

    def prepare(self, step: int) -> dict[str, float]:
        """Before step ``step``'s rollout: on a reset step, reset the reference and draw the interval's anchors (or
        read them back); on a resumed run's first step, read its interval's anchors."""
        beta = self.cfg.algo.armor.reset_every
        start = step - step % beta
        if self.interval is not None and self.interval.start == start:
            return {"anchor/reset": 0.0}
        if step == start:
            self.reset()  # the engine holds the policy's weights now: they are the reference from here on
            self.interval = self._read(start) or self._draw(start)
            return {"anchor/reset": 1.0}
        interval = self._read(start)
        if interval is None:
            raise ConfigError(
                f"algo.armor.anchors: resuming at step {step}, but {self.path(start)} (the anchors the reference of "
                f"step {start} drew) is missing and the engine no longer holds that reference; restore the file or "
                "start the run afresh"
            )
        self.interval = interval
        return {"anchor/reset": 0.0}

    def _draw(self, start: int) -> Interval:
        cfg = self.cfg
        # the whole interval, even past trainer.steps: a resumed run with more steps finds its anchors
        count = cfg.algo.armor.reset_every
        position = self.loader.state_dict()
        try:
            per_step = [self.loader.next_batch() for _ in range(count)]
        finally:
            self.loader.load_state_dict(position)  # read ahead only: each step draws its own prompts
        k = cfg.algo.armor.candidates
        rollout = dataclasses.replace(cfg.rollout, group_size=k)
        engine = without_prefixes(self.engine)
        steps, correct_total, drawn = [], 0, 0
        for offset, items in enumerate(per_step):
            completions = generate(
                engine, items, rollout, run_seed=cfg.trainer.seed, step=ANCHOR_STEP - start, refill_round=offset
            )
            rewards, _ = verify(self.pool, items, completions)
            correct = rewards.view(len(items), k) >= 1.0
            correct_total, drawn = correct_total + int(correct.sum()), drawn + correct.numel()
            row = []
            for i, (item, group, ok) in enumerate(zip(items, completions, correct.tolist())):
                j = next((j for j, good in enumerate(ok) if good), None)
                anchor = None if j is None else dataclasses.replace(group[j], routed_experts=None)
                row.append((item.id, anchor, 0.0 if j is None else float(rewards[i * k + j])))
            steps.append(row)
        interval = Interval(start, steps, correct_total, drawn)
        if not dist.is_initialized() or dist.get_rank() == 0:
            self._write(interval)
        if dist.is_initialized():
            dist.barrier()
        return interval

    def _header(self, start: int) -> dict:
        c = self.cfg
        r = c.rollout
        return {
            "format": FORMAT,
            "start": start,
            "candidates": c.algo.armor.candidates,
            "reset_every": c.algo.armor.reset_every,
            "seed": c.trainer.seed,
            "model": str(c.model.hf_dir),
            "sampling": [r.temperature, r.top_p, r.max_new_tokens, list(r.stop)],
        }

    def _write(self, interval: Interval) -> None:
        path = self.path(interval.start)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        # not dataclasses.asdict, which would turn the Completions into dicts: they are pickled as they are
        fields = {f.name: getattr(interval, f.name) for f in dataclasses.fields(interval)}
        torch.save({"header": self._header(interval.start), "interval": fields}, tmp)
        os.replace(tmp, path)  # readers see the old file or the new one, never a half-written one

    def _read(self, start: int) -> Interval | None:
        path = self.path(start)
        if not path.is_file():
            return None
        data = torch.load(path, weights_only=False)
        if data.get("header") != self._header(start):
            raise ConfigError(
                f"algo.armor.anchors: {path} was drawn for another setting ({data.get('header')}); use another "
                "trainer.output_dir, or delete the file"
            )
        return Interval(**data["interval"])

    def attach(self, step: int, exp: Experience) -> Experience:
        """Step ``step``'s experience with the anchors added (see the module doc), the anchor/* metrics in it."""
        interval = self.interval
        if interval is None or not 0 <= step - interval.start < len(interval.steps):
            raise RuntimeError(f"AnchorRollout.attach: no anchors for step {step}; call prepare(step) first")
        row = interval.steps[step - interval.start]
        ids = [item.id for item in exp.items]
        drawn_for = [i for i, _, _ in row]
        if ids != drawn_for:
            raise RuntimeError(
                f"step {step}: the anchors were drawn for prompts {drawn_for[:4]}..., the step trains {ids[:4]}... "
                "(the loader's order changed)"
            )
        return with_anchors(exp, [(a, r) for _, a, r in row], self.cfg, self.pad_id, interval)


def with_anchors(
    exp: Experience,
    anchors: list[tuple[Completion | None, float]],
    cfg: Config,
    pad_id: int,
    interval: Interval | None = None,
) -> Experience:
    """G - 1 policy samples per group + its anchor and the anchor's reward (a placeholder copy of the first sample
    where there is none, masked out with its whole group) -> the G-sample `Experience`, the anchor/* metrics among its
    metrics."""
    g = cfg.rollout.group_size
    policy_g = g - 1
    groups, rewards, keep, found = [], [], [], []
    for i, (item, (anchor, anchor_reward)) in enumerate(zip(exp.items, anchors)):
        own = exp.rollouts.rewards[i * policy_g : (i + 1) * policy_g]
        varied = bool((own != own[0]).any())
        completions = list(exp.completions[i]) + [anchor if anchor is not None else exp.completions[i][0]]
        group = group_of(0, i, item, completions, torch.cat([own, torch.tensor([anchor_reward])]), cfg)
        # the policy rewards already hold their overlong penalty: add the anchor's alone
        group.rewards[:policy_g] = own
        groups.append(group)
        rewards.append(group.rewards)
        found.append(anchor is not None)
        keep.append(varied and anchor is not None)
    flat = torch.cat(rewards)
    advantages, _ = compute_advantages(flat, g, cfg.algo)
    items, completions = exp.items, [grp.completions for grp in groups]
    kept = torch.tensor(keep).repeat_interleave(g)
    anchor_rows = (torch.arange(len(flat)) % g) == g - 1
    kept &= ~anchor_rows | (advantages > 0)  # anchors are positive samples only
    trains = kept & untruncated(completions, cfg.algo.mask_truncated)
    rollouts = to_rollouts(items, completions, flat, pad_id, trains=trains)
    n = max(len(exp.items), 1)
    metrics = {
        "anchor/groups_trained": float(sum(keep)),
        "anchor/dropped_no_anchor": float(sum(not f for f in found)),
        "anchor/dropped_uniform": float(sum(f and not k for f, k in zip(found, keep))),
        "anchor/found_frac": sum(found) / n,
    }
    if interval is not None:
        metrics["anchor/reference_pass_rate"] = interval.candidates_correct / max(interval.candidates_drawn, 1)
    return dataclasses.replace(
        exp,
        completions=completions,
        rollouts=rollouts,
        targets=Targets(advantages=advantages.float()),
        metrics=exp.metrics | metrics,
    )
