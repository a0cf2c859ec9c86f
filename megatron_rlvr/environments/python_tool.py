"""The built-in Python tool environment (``environment.name: python_tool``, docs/multi-turn.md).

A turn of the policy that holds a fenced ```python block (the last one counts), or lines starting with ``>>> ``, is a
tool call: the code runs in the reward sandbox (`rewards.sandbox.run_python`: a private filesystem, no network, one
memory budget, per-call wall/CPU limits; docs/sandbox.md) and its stdout, with the tail of stderr when it failed, is
the observation. ``>>>`` lines (with their ``...`` continuations) run as in the REPL, which shows the value of each
expression. Unlike the REPL, each call is a fresh interpreter in a fresh sandbox: no variable, import or file
survives to the next call, as in verl's and SkyRL's code tools, and the trajectory's first observation says so
(`FRESH_EACH_CALL`). Any other turn is the answer: the trajectory ends, and its reward is the row's verifier on that
turn, the one the run's reward pool would use under ``reward`` (`rewards.verifiers.VerifierTable`: reasoning-gym's
answer reading, plugins; countdown's checks its first line). Tool calls earn nothing themselves. The observation is
capped at ``environment.tool_output_chars`` here and at ``environment.observation_tokens`` tokens by the episode
runner.
"""

from __future__ import annotations

import ast
import re

from megatron_rlvr.environments.base import Message, Problem, Step
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards.sandbox import SandboxLimits, run_python
from megatron_rlvr.rewards.verifiers import VerifierTable

_FENCED = re.compile(r"```python[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_REPL, _MORE = ">>> ", "... "
FRESH_EACH_CALL = "[a fresh Python each call: nothing is kept between calls]\n"  # heads the first observation


def tool_limits(cfg: EnvironmentConfig, accept_rlimits_only: bool = False) -> SandboxLimits:
    """The sandbox of one tool call; ``accept_rlimits_only`` is ``reward.sandbox_accept_rlimits_only``."""
    return SandboxLimits(
        cpu_s=cfg.tool_cpu_s,
        wall_s=cfg.tool_wall_s,
        memory_mb=cfg.tool_memory_mb,
        tmpfs_mb=cfg.tool_tmpfs_mb,
        nproc=cfg.tool_nproc,
        output_chars=cfg.tool_output_chars,
        accept_rlimits_only=accept_rlimits_only,
    )


def check_memory_fits(cfg: EnvironmentConfig) -> None:
    """ConfigError naming the keys when ``environment.workers`` tool programs at their full budgets exceed the
    available memory (each worker runs one program at a time), as the reward pool checks its code sandboxes."""
    import psutil

    per_program = cfg.tool_memory_mb + cfg.tool_tmpfs_mb
    available = psutil.virtual_memory().available >> 20
    if cfg.workers * per_program > available:
        raise ConfigError(
            f"environment.workers ({cfg.workers}) x (environment.tool_memory_mb ({cfg.tool_memory_mb}) + "
            f"environment.tool_tmpfs_mb ({cfg.tool_tmpfs_mb})) = {cfg.workers * per_program} MB of tool-sandbox "
            f"memory does not fit in this machine's available memory ({available} MB); lower environment.workers "
            "or environment.tool_memory_mb"
        )


def tool_call(response: str) -> str | None:
    """The program a turn asks to run, or None when the turn is an answer."""
    blocks = _FENCED.findall(response)
    if blocks:
        return blocks[-1]
    lines, in_call = [], False
    for line in response.splitlines():  # a REPL transcript: ">>> " lines and the "... " lines that continue them
        if line.startswith(_REPL) or (in_call and (line.startswith(_MORE) or line == _MORE.strip())):
            lines.append(line[len(_REPL) :])
            in_call = True
        else:
            in_call = False
    if not lines:
        return None
    return _as_in_the_repl("\n".join(lines))


def _as_in_the_repl(code: str) -> str:
    """``code`` with the value of each top-level expression shown, as the REPL shows it (`sys.displayhook`)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code  # it fails in the sandbox, and the policy reads why
    hook = ast.parse("__import__('sys').displayhook", mode="eval").body
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Expr):
            tree.body[i] = ast.copy_location(ast.Expr(ast.Call(hook, [node.value], [])), node)
    return ast.unparse(ast.fix_missing_locations(tree))


def observation_of(stdout: str, stderr: str, returncode: int, timed_out: bool, chars: int) -> str:
    """What the policy reads of a run: stdout, then (on failure) the last line of stderr, capped at ``chars``."""
    text = stdout
    if timed_out:
        text += "\n[timed out]"
    elif returncode != 0:
        last = stderr.strip().splitlines()[-1:] or [f"exit status {returncode}"]
        text += ("\n" if text and not text.endswith("\n") else "") + last[0]
    return text[:chars]


class PythonToolEnvironment:
    """One trajectory with a Python tool; an `Environment`."""

    def __init__(self, limits: SandboxLimits, verifiers: VerifierTable):
        self.limits = limits
        self.verifiers = verifiers
        self.problem: Problem | None = None
        self.calls = 0

    def reset(self, problem: Problem) -> list[Message]:
        self.problem = problem
        self.calls = 0
        return []  # the data's prompt as it is

    def step(self, response: str) -> Step:
        if self.problem is None:
            raise RuntimeError("PythonToolEnvironment.step before reset")
        code = tool_call(response)
        if code is None:
            return Step("", self.verifiers.score_row(self.problem.task, response, self.problem.answer), True)
        run = run_python(code, "", self.limits)
        self.calls += 1
        seen = observation_of(run.stdout, run.stderr, run.returncode, run.timed_out, self.limits.output_chars)
        return Step((FRESH_EACH_CALL if self.calls == 1 else "") + seen, 0.0, False)
