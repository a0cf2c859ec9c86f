"""The Python tool: tool calls, answers, the output cap, what survives a call (nothing, and the first observation
says so), and the reward sandbox's hostile programs sent through it, contained exactly as in tests/unit/rewards (the same
programs, the same checks; tests/unit/rewards/test_sandbox_unprivileged.py sends them through the tool as a non-root user
too)."""

import os
import shutil
import uuid
from pathlib import Path

import pytest

from megatron_rlvr.environments import EnvironmentConfig, Problem
from megatron_rlvr.environments.host import EnvironmentHost
from megatron_rlvr.environments.python_tool import FRESH_EACH_CALL, PythonToolEnvironment, tool_call, tool_limits
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.sandbox import SandboxUnavailableError, sandbox_info, use_containment
from megatron_rlvr.rewards.verifiers import VerifierTable
from tests.unit.rewards.sandbox_helpers import (
    DISK_FILL,
    FORK_BOMB,
    READ_FILES,
    leftovers,
    sandbox_processes,
    with_stdin,
)

needs_isolation = pytest.mark.skipif(not sandbox_info().isolated, reason="the kernel refuses every namespace")

# the sandbox tests' small budgets, as environment keys
CFG = EnvironmentConfig(
    name="python_tool", tool_cpu_s=10, tool_wall_s=30, tool_memory_mb=256, tool_nproc=16, tool_tmpfs_mb=64
)
PROBLEM = Problem("countdown-1", "3 7 4 9 -> 31:", (1, 2), "countdown", {"numbers": [3, 7, 4, 9], "target": 31})


def _tool(problem: Problem = PROBLEM, reward: RewardConfig | None = None) -> PythonToolEnvironment:
    env = PythonToolEnvironment(tool_limits(CFG), VerifierTable(reward or RewardConfig()))
    assert env.reset(problem) == []
    return env


def _fenced(program: str) -> str:
    return f"Let me compute.\n```python\n{program}```\n"


def test_tool_calls_run_and_answers_are_scored():
    env = _tool()
    step = env.step(_fenced("print(3 * 7 + 4)\n"))
    assert (step.observation, step.reward, step.done) == (FRESH_EACH_CALL + "25\n", 0.0, False)
    assert env.step(">>> 3 * 7 + 9 - 4 // 4").observation == "29\n"  # an expression is printed, as in the REPL
    assert "ZeroDivisionError" in env.step(">>> 1 / 0").observation  # the last line of stderr
    assert len(env.step(_fenced("print('x' * 100000)\n")).observation) == CFG.tool_output_chars
    assert tool_call("3 * 7 + 4") is None
    transcript = ">>> total = 0\n>>> for n in (3, 7):\n...     total += n\n...\n>>> total\n>>> 'done'\nso 10"
    assert env.step(transcript).observation == "10\n'done'\n"  # each expression shown, as the REPL shows it
    answer = env.step("3 * 7 + 4\n")
    assert answer.done and answer.reward == 0.0  # 25, not 31
    assert _tool().step("3 * 7 + 4 * 9 - 26\n").reward == 0.0  # 26 is not given
    right = _tool().step("3 * 9 + 4\n")
    assert right.done and right.reward == 1.0


def test_answers_are_scored_by_the_runs_verifiers():
    """A reasoning-gym row is scored as the reward pool scores it, with the run's reward.answer."""
    problem = Problem(
        "rg-1", "Calculate 95 - 21.", (1,), "reasoning_gym:basic_arithmetic", {"answer": "74", "metadata": {}}
    )
    assert _tool(problem, RewardConfig(answer="last_number")).step("95 - 21 = 74.").reward == 1.0
    assert _tool(problem, RewardConfig(answer="last_number")).step("It is 75.").reward == 0.0
    assert _tool(problem, RewardConfig(answer="tagged")).step("95 - 21 = 74.").reward < 1.0  # no <answer> tags
    assert _tool(problem, RewardConfig(answer="tagged")).step("<answer>74</answer>").reward == 1.0


def test_the_tool_workers_must_fit_their_sandbox_budgets_in_memory():
    # checked before any worker starts: 4 programs of 1 TB each cannot all hold their budgets on any machine here
    with pytest.raises(ConfigError, match=r"environment\.workers \(4\).*environment\.tool_memory_mb.*available"):
        EnvironmentHost(EnvironmentConfig(name="python_tool", workers=4, tool_memory_mb=1 << 20))


def test_nothing_survives_a_call_and_the_first_observation_says_so():
    env = _tool()
    first = env.step(">>> x = 6 * 7\n>>> x").observation
    assert first == FRESH_EACH_CALL + "42\n"
    assert "NameError: name 'x' is not defined" in env.step(">>> x").observation  # a fresh interpreter each call
    assert env.step(_fenced("open('kept', 'w').write('1')\n")).observation == ""
    assert "FileNotFoundError" in env.step(_fenced("print(open('kept').read())\n")).observation  # its files too
    env.reset(PROBLEM)  # a new trajectory is told again
    assert env.step(">>> 1 + 1").observation == FRESH_EACH_CALL + "2\n"


def test_without_isolation_the_tool_host_refuses_to_start_unless_rlimits_only_is_accepted():
    with use_containment("none"):
        with pytest.raises(SandboxUnavailableError, match=r"environment\.name=python_tool"):
            EnvironmentHost(CFG, RewardConfig())
        accepted = PythonToolEnvironment(tool_limits(CFG, accept_rlimits_only=True), VerifierTable(RewardConfig()))
        accepted.reset(PROBLEM)
        assert accepted.step(">>> 2 + 2").observation == FRESH_EACH_CALL + "4\n"


@needs_isolation
def test_hostile_programs_through_the_tool_are_contained():
    env = _tool()
    secret = uuid.uuid4().hex
    path = Path("/tmp") / f"rlvr_tests_{uuid.uuid4().hex}.json"  # its name is in the error the tool returns
    try:
        path.write_text(secret)
        os.chmod(path, 0o644)  # readable by any uid: only the filesystem view can keep it out
        seen = env.step(_fenced(with_stdin(READ_FILES, str(path)))).observation.removeprefix(FRESH_EACH_CALL)
        assert secret not in seen and "FileNotFoundError" in seen, seen
    finally:
        path.unlink(missing_ok=True)

    children = env.step(_fenced(FORK_BOMB)).observation
    assert int(children) < CFG.tool_nproc, children
    assert sandbox_processes() == []  # the sleeping children died with their PID namespace

    free_before = shutil.disk_usage("/tmp").free
    filled = env.step(_fenced(DISK_FILL)).observation
    written, fs_mb = map(int, filled.split()[-2:])
    assert "No space left" in filled and fs_mb == CFG.tool_tmpfs_mb, filled
    assert written <= CFG.tool_tmpfs_mb, filled  # /tmp and /dev/shm share the one capped tmpfs
    assert free_before - shutil.disk_usage("/tmp").free < 100 << 20  # its ~3 x 64 MB never reached the host disk
    assert leftovers() == [] and sandbox_processes() == []
