"""The run's start check for the programs a policy writes: a run that will execute them (rows whose verifier runs
the response, or the Python tool) gets isolation for them, or stops before its first step with one line that names
the missing kernel feature and ``reward.sandbox_accept_rlimits_only``, the key that accepts rlimits-only containment.

A run that executes no program (math, logic, countdown, reasoning-gym) needs no sandbox and is never stopped here.
The sandbox itself refuses as well (`sandbox.run_python`), so a program that reaches it by another path (an eval
benchmark) is refused there, and the reward pool stops on it (`pool.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.sandbox import SandboxInfo, SandboxUnavailableError, check_isolation
from megatron_rlvr.rewards.scoring import code_limits

log = logging.getLogger(__name__)

PROGRAM_TASKS = frozenset({"code"})  # tasks whose verifier executes the response (code.py)
PROGRAM_ENVIRONMENTS = frozenset({"python_tool"})  # environments that execute the policy's turns


def programs_in_run(tasks: Iterable[str], environment: str = "") -> list[str]:
    """What in a run executes policy-written programs: its rows' tasks and its environment ([] when nothing)."""
    found = [f"rows of task {task!r}" for task in sorted(set(tasks) & PROGRAM_TASKS)]
    if environment in PROGRAM_ENVIRONMENTS:
        found.append(f"environment.name={environment}")
    return found


def check_run_containment(reward: RewardConfig, tasks: Iterable[str], environment: str = "") -> SandboxInfo | None:
    """Before a run's first step: the containment its programs get (logged), None when it runs no program; raises
    `SandboxUnavailableError` (one line) when they would get no isolation and ``reward`` does not accept that."""
    sources = programs_in_run(tasks, environment)
    if not sources:
        return None
    try:
        info = check_isolation(reward.sandbox_accept_rlimits_only)
    except SandboxUnavailableError as exc:
        raise SandboxUnavailableError(f"{exc} (this run executes them: {', '.join(sources)})") from None
    log.info("%s (for %s)", info.describe(code_limits(reward)), ", ".join(sources))
    return info
