"""Configuration of multi-turn rollouts (docs/multi-turn.md): which environment the policy talks to, its turn limit,
how much of an observation the policy reads, and the worker processes and deadlines that contain the environment.

The trajectory's token budget is ``rollout.max_new_tokens`` (``eval.max_new_tokens`` in validation): every token after
the prompt, sampled or written by the environment, counts against it, so the response length every other part of the
system sizes for (the memory plan, ``rollout.max_model_len``, the overlong penalty) holds for trajectories too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EnvironmentConfig:
    # "" = single-turn (no environment); "python_tool" (the built-in Python tool, environments/python_tool.py); or a
    # user's environment: "package.module:factory" or "FILE.py:factory", a callable of no arguments returning a fresh
    # `Environment` (one per trajectory), imported in the environment's worker processes
    name: str = ""
    max_turns: int = 4  # the policy's turns per trajectory; a trajectory not done after the last one is cut there
    turn_max_tokens: int = 0  # sampled tokens per turn at most (0: what is left of the trajectory's budget)
    observation_tokens: int = 64  # an observation is cut to this many tokens (before the template's glue)
    observation_role: str = "tool"  # the chat-template role of observations (templates without it: "user")
    workers: int = 2  # processes hosting the environments; a hung or crashed one is killed and replaced
    call_timeout_s: float = 30.0  # wall deadline of one environment call (reset or one step of one trajectory)
    # the Python tool's sandbox (docs/sandbox.md), per call: the code of one fenced block or `>>>` line
    tool_wall_s: float = 5.0
    tool_cpu_s: float = 5.0
    tool_memory_mb: int = 256
    tool_tmpfs_mb: int = 16
    tool_nproc: int = 16
    tool_output_chars: int = 4096  # stdout/stderr kept per call, before the token cut

    def __post_init__(self) -> None:
        positive = {
            "max_turns": self.max_turns,
            "observation_tokens": self.observation_tokens,
            "workers": self.workers,
            "call_timeout_s": self.call_timeout_s,
            "tool_wall_s": self.tool_wall_s,
            "tool_cpu_s": self.tool_cpu_s,
            "tool_memory_mb": self.tool_memory_mb,
            "tool_tmpfs_mb": self.tool_tmpfs_mb,
            "tool_nproc": self.tool_nproc,
            "tool_output_chars": self.tool_output_chars,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"environment.{key}: expected a positive number, got {value}")
        if self.turn_max_tokens < 0:
            raise ValueError(f"environment.turn_max_tokens: expected >= 0 (0: no cap), got {self.turn_max_tokens}")
        if not self.observation_role:
            raise ValueError("environment.observation_role: expected a chat role such as 'tool' or 'user'")

    @property
    def enabled(self) -> bool:
        return bool(self.name)
