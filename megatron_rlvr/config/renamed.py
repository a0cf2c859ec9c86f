"""Keys that moved or went away, and what to set instead: a recipe or override that still names one fails with one
line naming its new key (the loader), and a checkpoint's stored config is read with today's keys (`upgraded`), so a
run resumed across the change compares like with like.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_rlvr.config.run import Config

# old dotted key -> the key that holds its value now (``algo`` split into sections)
RENAMED: dict[str, str] = {
    "algo.loss_agg": "algo.loss.agg",
    "algo.max_len_norm": "algo.loss.max_len_norm",
    "algo.eps_low": "algo.loss.eps_low",
    "algo.eps_high": "algo.loss.eps_high",
    "algo.top_n": "algo.loss.top_n",
    "algo.alpha": "algo.loss.alpha",
    "algo.lambda_top1": "algo.loss.lambda_top1",
    "algo.tau_q": "algo.loss.tau_q",
    "algo.weights": "algo.loss.weights",
    "algo.apply_to": "algo.loss.apply_to",
    "algo.candidates": "algo.loss.candidates",
    "algo.candidate_mass": "algo.loss.candidate_mass",
    "algo.beta": "algo.loss.beta",
    "algo.kappa": "algo.loss.kappa",
    "algo.cov_fraction": "algo.loss.cov_fraction",
    "algo.lambda_pos": "algo.loss.lambda_pos",
    "algo.normalize_std": "algo.advantage.normalize_std",
    "algo.adv_eps": "algo.advantage.eps",
    "algo.kl_coef": "algo.kl.coef",
    "algo.pba": "algo.kl.pba.enabled",
    "algo.pba_base_samples": "algo.kl.pba.base_samples",
    "algo.pba_min_correct": "algo.kl.pba.min_correct",
    "algo.pba_kl_coef": "algo.kl.pba.coef",
    "algo.rollout_correction_level": "algo.rollout_correction.level",
    "algo.rollout_is_cap": "algo.rollout_correction.cap",
    "algo.rollout_is_low": "algo.rollout_correction.low",
    "algo.rollout_is_high": "algo.rollout_correction.high",
    "algo.distill_coef": "algo.distill.coef",
    "algo.distill_only": "algo.distill.only",
    "algo.distill_signal": "algo.distill.signal",
    "algo.distill_top_n": "algo.distill.top_n",
    "algo.teacher_hf_dir": "algo.distill.teacher_hf_dir",
    "algo.self_distill_template": "algo.distill.template",
    "algo.crpo_top_k": "algo.distill.crpo.top_k",
    "algo.crpo_positive_share": "algo.distill.crpo.positive_share",
    "algo.crpo_tau": "algo.distill.crpo.tau",
    "algo.crpo_coef": "algo.distill.crpo.coef",
    "algo.crpo_correct_reward": "algo.distill.crpo.correct_reward",
    "algo.crpo_teacher": "algo.distill.crpo.teacher",
    "algo.crpo_ema_decay": "algo.distill.crpo.ema_decay",
    "algo.anchor_rollout": "algo.armor.anchors",
    "algo.anchor_candidates": "algo.armor.candidates",
    "algo.anchor_reset_every": "algo.armor.reset_every",
    "algo.mixed_ratio_share": "algo.armor.mixed_ratio_share",
}

# old keys whose value is now a section's type field (``algo.loss: casp`` is ``algo.loss.kind: casp``)
BECAME_SECTIONS: dict[str, str] = {
    "algo.loss": "algo.loss.kind",
    "algo.advantage": "algo.advantage.kind",
    "algo.rollout_correction": "algo.rollout_correction.kind",
    "algo.distill": "algo.distill.kind",
}

# keys that changed nothing or moved elsewhere, with what to set instead
REMOVED: dict[str, str] = {
    "model.dtype": "actor.bf16 (true: bf16 compute; the rollout engines serve in the same dtype) and, for "
    "evaluation, eval.dtype",
    "trainer.off_policy_steps": "rollout.max_staleness (0: on-policy, 1: one-step-off, k >= 2: fully asynchronous; "
    "docs/async.md)",
}


def instead(key: str, value: Any = None) -> str | None:
    """The one line for an old ``key`` (holding ``value``), or None when the key is not an old one."""
    if key in RENAMED:
        return f"{key}: renamed; set {RENAMED[key]}"
    if key in BECAME_SECTIONS and not isinstance(value, Mapping):
        example = f" (e.g. {BECAME_SECTIONS[key]}={value})" if isinstance(value, str) else ""
        return f"{key}: now a section; set {BECAME_SECTIONS[key]}{example}"
    if key in REMOVED:
        return f"{key}: removed; set {REMOVED[key]}"
    return None


def upgraded(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A stored config tree (``to_dict``) with every old key moved to its new place, and every key added since it was
    written at today's default: the run that wrote it ran without that knob, which a new knob's default leaves as it
    was (a copy; keys it holds stay)."""
    out = copy.deepcopy(dict(tree))
    for old, new in [*BECAME_SECTIONS.items(), *RENAMED.items()]:
        section, name = old.rsplit(".", 1)
        parent = out.get(section)
        if not isinstance(parent, dict) or name not in parent or isinstance(parent[name], Mapping):
            continue
        value = parent.pop(name)
        node = out
        *path, last = new.split(".")
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[last] = value
    return _with_defaults(out, dataclasses.asdict(Config()))


def _with_defaults(tree: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with every key of ``defaults`` that it lacks, at any depth, set to its default."""
    for key, default in defaults.items():
        if key not in tree:
            tree[key] = copy.deepcopy(default)
        elif isinstance(default, Mapping) and isinstance(tree[key], dict):
            _with_defaults(tree[key], default)
    return tree
