"""Configuration of the verifiers and of the verifier pool the trainer scores responses with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rlvr.rewards.answers import ANSWER_FORMATS, AnswerFormat


@dataclass
class RewardConfig:
    workers: int = 2  # verifier processes (all but countdown and generic-logic items, which are scored in-process)
    timeout_s: float = 10.0  # wall time per math item; a worker past it is killed and replaced
    worker_memory_mb: int = 4096  # address-space limit of each verifier process (0 = none)
    logic_match: Literal["normalized", "exact"] = "normalized"
    # how the answer string of a reasoning_gym:NAME row is read from the response (answers.py): "tagged" (the last
    # <answer>...</answer>, else the whole response), "last_number" or "boxed" (chat answers, which carry no tags)
    answer: AnswerFormat = "tagged"
    code_cpu_s: float = 5.0  # per program run
    code_wall_s: float = 10.0  # per program run; a code item's pool timeout is this times its runs, plus slack
    # one budget for the whole program, all its processes together (a memory cgroup; else rlimits sized so that
    # address space x processes fits it); the pool checks workers x (code_memory_mb + code_tmpfs_mb) fits at start
    code_memory_mb: int = 1024
    code_file_size_mb: int = 16
    code_nproc: int = 32  # processes of the program's own uid (fork bombs stop here)
    code_tmpfs_mb: int = 64  # the program's private writable tmpfs (work dir, /tmp, /dev/shm): RAM, not disk
    # where no namespaces can be had (not root and user namespaces turned off), run code items and the Python tool
    # with rlimits only, on the host's files and network (true), or stop the run before its first step (false)
    sandbox_accept_rlimits_only: bool = False
    # DAPO's soft overlong penalty (docs/algorithms.md): with budget L_max = rollout.max_new_tokens and buffer
    # L_c = overlong_buffer, a response of L tokens gets overlong_penalty * min(0, (L_max - L_c - L) / L_c) added to
    # its reward, floored at -overlong_penalty. 0 = off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # verifiers users bring (docs/rewards.md): TASK -> "package.module:function" or "FILE.py:function" (a path),
    # fn(response, reference) -> float in [0, 1], run in the workers; imported and checked when the config loads
    # (load_config calls verifiers.check_config) and by every pool worker
    plugins: dict[str, str] = field(default_factory=dict)
    # a checkout of github.com/MiniMax-AI/SynLogic: logic rows whose data_source it verifies use its official verifier
    synlogic_dir: str = ""
    logic_fallback: bool = True  # other logic rows: the generic matcher (true) or an error naming the row (false)

    def __post_init__(self) -> None:
        if self.answer not in ANSWER_FORMATS:
            raise ValueError(f"reward.answer: expected one of {list(ANSWER_FORMATS)}, got {self.answer!r}")
