"""PBA, per-problem base anchoring (docs/algorithms.md, "PBA"): which responses get the KL-to-base term.

Base evidence ``c_b`` is the number of correct answers among ``pba_base_samples`` samples of the frozen base per
training prompt (drawn once before training: base_evidence.py). Prompts with ``c_b >= pba_min_correct`` are
sharpened with the plain loss (plus ``algo.kl.coef`` if set); the others are "risky" (rare or no base evidence) and
their responses are anchored to the base with ``pba_kl_coef``. The coefficient travels per response
(``Targets.kl_coef``) into ``policy_loss``'s k3 term, so PBA composes with every loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


def _check(base_correct: Tensor, cfg: AlgoConfig) -> Tensor:
    if not isinstance(base_correct, Tensor) or base_correct.dim() != 1:
        raise ValueError(
            f"base_correct: expected a 1-D tensor [prompts] of correct counts, got "
            f"{getattr(base_correct, 'shape', base_correct)!r}"
        )
    counts = base_correct.detach().to(torch.float64)
    bad = ~torch.isfinite(counts) | (counts < 0) | (counts > cfg.kl.pba.base_samples) | (counts != counts.round())
    if bool(bad.any()):
        raise ValueError(
            f"base_correct: expected whole counts in [0, algo.kl.pba.base_samples = "
            f"{cfg.kl.pba.base_samples}], got {base_correct.tolist()}"
        )
    return counts


def risky_prompts(base_correct: Tensor, cfg: AlgoConfig) -> Tensor:
    """bool [prompts]: fewer than ``pba_min_correct`` correct base answers, so anchored to the base."""
    return _check(base_correct, cfg) < cfg.kl.pba.min_correct


def sequence_kl_coef(base_correct: Tensor, group_size: int, cfg: AlgoConfig) -> Tensor:
    """[prompts] correct counts -> [prompts * group_size] float32 per-response KL coefficient, each prompt's group
    contiguous (as compute_advantages lays them out): ``pba_kl_coef`` for a risky prompt's responses,
    ``algo.kl.coef`` for the others."""
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    risky = risky_prompts(base_correct, cfg)
    coef = torch.where(
        risky, torch.tensor(cfg.kl.pba.coef, dtype=torch.float64), torch.tensor(cfg.kl.coef, dtype=torch.float64)
    )
    return coef.repeat_interleave(group_size).to(torch.float32)


def pba_metrics(base_correct: Tensor, cfg: AlgoConfig) -> dict[str, float]:
    """``pba/anchored_frac``: share of the prompts that are risky; ``pba/base_pass_rate``: the base's pass@1 over
    them, mean of c_b / pba_base_samples (0 for no prompts)."""
    counts = _check(base_correct, cfg)
    if counts.numel() == 0:
        return {"pba/anchored_frac": 0.0, "pba/base_pass_rate": 0.0}
    return {
        "pba/anchored_frac": float((counts < cfg.kl.pba.min_correct).to(torch.float64).mean()),
        "pba/base_pass_rate": float(counts.mean() / cfg.kl.pba.base_samples),
    }
