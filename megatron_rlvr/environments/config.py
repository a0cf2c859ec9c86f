"""Configuration of multi-turn rollouts (docs/multi-turn.md): which environment the policy talks to, its turn limit,
how much of an observation the policy reads, and the worker processes and deadlines that contain the environment.

The trajectory's token budget is ``rollout.max_new_tokens`` (``eval.max_new_tokens`` in validation): every token after
the prompt, sampled or written by the environment, counts against it, so the response length every other part of the
system sizes for (the memory plan, ``rollout.max_model_len``, the overlong penalty) holds for trajectories too.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.settings import setting


@dataclass
class EnvironmentConfig:
    """The environment a multi-turn policy talks to, and what contains it."""

    name: str = setting(
        "",
        "'' = single-turn (no environment); python_tool (the built-in Python tool, environments/python_tool.py); or a "
        "user's environment: 'package.module:factory' or 'FILE.py:factory', a callable of no arguments returning a "
        "fresh `Environment` (one per trajectory), imported in the environment's worker processes.",
    )
    max_turns: int = setting(
        4, "The policy's turns per trajectory; a trajectory not done after the last one is cut there.", gt=0
    )
    turn_max_tokens: int = setting(
        0, "Sampled tokens per turn at most (0: what is left of the trajectory's budget).", ge=0
    )
    observation_tokens: int = setting(
        64, "An observation is cut to this many tokens (before the template's glue).", gt=0
    )
    observation_role: str = setting(
        "tool",
        "The chat-template role of observations (templates without it: user).",
        check=bool,
        expect="a chat role such as 'tool' or 'user'",
    )
    workers: int = setting(2, "Processes hosting the environments; a hung or crashed one is killed and replaced.", gt=0)
    call_timeout_s: float = setting(
        30.0, "Wall deadline of one environment call (reset or one step of one trajectory).", gt=0
    )
    tool_wall_s: float = setting(
        5.0, "The Python tool's sandbox (docs/sandbox.md), per call (one fenced block or >>> line): wall seconds.", gt=0
    )
    tool_cpu_s: float = setting(5.0, "The Python tool: CPU seconds per call.", gt=0)
    tool_memory_mb: int = setting(256, "The Python tool: memory per call.", gt=0)
    tool_tmpfs_mb: int = setting(16, "The Python tool: its private tmpfs.", gt=0)
    tool_nproc: int = setting(16, "The Python tool: processes per call.", gt=0)
    tool_output_chars: int = setting(4096, "The Python tool: stdout/stderr kept per call, before the token cut.", gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.name)
