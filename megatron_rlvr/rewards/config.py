"""Configuration of the verifiers and of the verifier pool the trainer scores responses with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rlvr.rewards.answers import AnswerFormat
from megatron_rlvr.settings import setting


@dataclass
class RewardConfig:
    """The verifiers and the pool of processes that run them."""

    workers: int = setting(
        2, "Verifier processes (all but countdown and generic-logic items, which are scored in-process).", ge=1
    )
    timeout_s: float = setting(10.0, "Wall time per math item; a worker past it is killed and replaced.", gt=0)
    worker_memory_mb: int = setting(4096, "Address-space limit of each verifier process (0 = none).", ge=0)
    logic_match: Literal["normalized", "exact"] = setting("normalized", "How a logic answer is compared.")
    answer: AnswerFormat = setting(
        "tagged",
        "How the answer string of a reasoning_gym:NAME row is read from the response (answers.py): tagged (the last "
        "<answer>...</answer>, else the whole response), last_number or boxed (chat answers, which carry no tags).",
    )
    code_cpu_s: float = setting(5.0, "CPU seconds per program run.", gt=0)
    code_wall_s: float = setting(
        10.0, "Wall seconds per program run; a code item's pool timeout is this times its runs, plus slack.", gt=0
    )
    code_memory_mb: int = setting(
        1024,
        "One budget for the whole program, all its processes together (a memory cgroup; else rlimits sized so that "
        "address space x processes fits it); the pool checks workers x (code_memory_mb + code_tmpfs_mb) fits at "
        "start.",
        ge=1,
    )
    code_file_size_mb: int = setting(16, "The largest file a program may write.", ge=0)
    code_nproc: int = setting(32, "Processes of the program's own uid (fork bombs stop here).", ge=1)
    code_tmpfs_mb: int = setting(
        64, "The program's private writable tmpfs (work dir, /tmp, /dev/shm): RAM, not disk.", ge=1
    )
    sandbox_accept_rlimits_only: bool = setting(
        False,
        "Where no namespaces can be had (not root and user namespaces turned off), run code items and the Python "
        "tool with rlimits only, on the host's files and network (true), or stop the run before its first step "
        "(false).",
    )
    overlong_buffer: int = setting(
        0,
        "DAPO's soft overlong penalty (docs/algorithms.md): with budget L_max = rollout.max_new_tokens and buffer "
        "L_c = overlong_buffer (< L_max), a response of L tokens gets overlong_penalty * min(0, (L_max - L_c - L) / "
        "L_c) added to its reward, floored at -overlong_penalty. 0 = off.",
        ge=0,
    )
    overlong_penalty: float = setting(1.0, "The overlong penalty's size.", ge=0)
    plugins: dict[str, str] = setting(
        factory=dict,
        doc="Verifiers users bring (docs/rewards.md): TASK -> 'package.module:function' or 'FILE.py:function' (a "
        "path), fn(response, reference) -> float in [0, 1], run in the workers; imported and checked when the "
        "config loads and by every pool worker.",
    )
    synlogic_dir: str = setting(
        "",
        "A checkout of github.com/MiniMax-AI/SynLogic: logic rows whose data_source it verifies use its official "
        "verifier.",
    )
    logic_fallback: bool = setting(
        True, "Other logic rows: the generic matcher (true) or an error naming the row (false)."
    )
