"""One entry for the built-in verifiers: `score(task, response, reference)` dispatching on the task type (which
verifier scores a row, plugins, SynLogic and reasoning-gym included, is `verifiers.py`'s decision).

Tasks and their references: ``"math"`` — the gold answer string; ``"code"`` — a dict with ``tests`` or ``io`` (see
`code.py`); ``"logic"`` — the gold answer string; ``"countdown"`` — ``{"numbers": [ints], "target": int}``.
A malformed reference or an unknown task is a ValueError naming it (a data bug); a bad response only scores 0.
"""

from __future__ import annotations

from typing import Any

from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.countdown import check_reference as check_countdown_reference
from megatron_rlvr.rewards.countdown import score_countdown
from megatron_rlvr.rewards.logic import verify_logic

TASKS = ("math", "code", "logic", "countdown")


def check_reference(task: str, reference: Any) -> None:
    """ValueError naming the task and the expected layout when ``reference`` cannot be scored against."""
    if task not in TASKS:
        raise ValueError(f"reward task {task!r}: unknown; expected one of {list(TASKS)}")
    if task in ("math", "logic"):
        if not isinstance(reference, str) or not reference.strip():
            raise ValueError(f"{task} reference: expected a non-empty gold answer string, got {reference!r:.200}")
    elif task == "countdown":
        check_countdown_reference(reference)
    else:
        from megatron_rlvr.rewards.code import check_code_reference

        check_code_reference(reference)


def code_limits(cfg: RewardConfig):
    from megatron_rlvr.rewards.sandbox import SandboxLimits

    return SandboxLimits(
        cpu_s=cfg.code_cpu_s,
        wall_s=cfg.code_wall_s,
        memory_mb=cfg.code_memory_mb,
        file_size_mb=cfg.code_file_size_mb,
        nproc=cfg.code_nproc,
        tmpfs_mb=cfg.code_tmpfs_mb,
        accept_rlimits_only=cfg.sandbox_accept_rlimits_only,
    )


def score(task: str, response: str, reference: Any, cfg: RewardConfig | None = None) -> float:
    """The reward (0.0 or 1.0) of one response. Math must run in a main thread (math-verify uses signal.alarm)."""
    cfg = cfg or RewardConfig()
    check_reference(task, reference)
    if not isinstance(response, str):
        raise TypeError(f"reward: the response must be a str, got {type(response).__name__}")
    if task == "countdown":
        return score_countdown(response, reference)
    if task == "logic":
        return verify_logic(response, reference, cfg.logic_match)
    if task == "math":
        from megatron_rlvr.rewards.math_verifier import verify_math

        return verify_math(response, reference)
    from megatron_rlvr.rewards.code import verify_code

    return verify_code(response, reference, code_limits(cfg))
