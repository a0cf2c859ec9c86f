"""What tests/unit/rewards/test_sandbox_unprivileged.py runs as an unprivileged user (`unprivileged.run_as`): reads its
payload (JSON) on stdin and prints what it saw as one JSON line; the test, as root, checks that and the host.

- ``contained``: the hostile programs of tests/unit/rewards (host files, network, host writes, fork bomb, disk fill,
  memory) through the code reward and through the Python tool, with the sandbox as it is for this user;
- ``refused``: where user namespaces are turned off: what the run's start check, the tool's host and the sandbox
  say, and a run once rlimits-only containment is accepted;
- ``train``: there too, `train` with the Python tool: what stops it (before it builds the actor);
- ``delegated``: with a memory cgroup directory root delegated to this user: the memory budget of many processes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from megatron_rlvr.environments import EnvironmentConfig, Problem
from megatron_rlvr.environments.python_tool import PythonToolEnvironment, tool_limits
from megatron_rlvr.errors import UserError
from megatron_rlvr.rewards.code import verify_code
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.sandbox import SandboxLimits, run_python, sandbox_info
from megatron_rlvr.rewards.verifiers import VerifierTable
from tests.unit.rewards.sandbox_helpers import (
    CONNECT,
    DISK_FILL,
    FORK_BOMB,
    READ_FILES,
    WRITE_FILES,
    io_reference,
    memory_by_many_processes,
    with_stdin,
)

# the containment tests' small budgets (tests/unit/rewards/test_sandbox_containment.py), as limits and as tool keys
LIMITS = SandboxLimits(cpu_s=10, wall_s=30, memory_mb=256, nproc=16, tmpfs_mb=64)
TOOL = EnvironmentConfig(
    name="python_tool", tool_cpu_s=10, tool_wall_s=30, tool_memory_mb=256, tool_nproc=16, tool_tmpfs_mb=64
)
MEMORY_HOG = "x = bytearray(8 * 1024**3)\nprint('ok')\n"


def _programs(payload: dict) -> dict[str, tuple[str, str]]:
    """Each hostile program with its stdin."""
    return {
        "read": (READ_FILES, payload["secret_path"]),
        "connect": (CONNECT, str(payload["port"])),
        "write": (WRITE_FILES, payload["write_path"]),
        "fork_bomb": (FORK_BOMB, ""),
        "disk_fill": (DISK_FILL, ""),
        "memory_by_processes": (memory_by_many_processes(6, 64), ""),
        "memory_hog": (MEMORY_HOG, ""),
    }


def contained(payload: dict) -> dict:
    info = sandbox_info()
    seen: dict = {"uid": os.getuid(), "isolation": info.isolation, "memory": info.memory, "reward": {}, "tool": {}}
    expected = {"read": payload["secret"], "connect": "connected", "write": "wrote", "fork_bomb": "1000"}
    for name, (program, stdin) in _programs(payload).items():
        run = run_python(program, stdin, LIMITS)
        seen["reward"][name] = {
            "stdout": run.stdout,
            "stderr": run.stderr[-500:],
            "returncode": run.returncode,
            "isolation": run.isolation,
            "score": verify_code(program, io_reference(expected.get(name, "ok"), stdin), LIMITS),
        }
    tool = PythonToolEnvironment(tool_limits(TOOL), VerifierTable(RewardConfig()))
    tool.reset(Problem("p", "", (1,), "countdown", {"numbers": [1, 2], "target": 3}))
    for name, (program, stdin) in _programs(payload).items():
        step = tool.step(f"```python\n{with_stdin(program, stdin)}```\n")
        seen["tool"][name] = step.observation
    return seen


def _refusal(call) -> str:
    try:
        call()
    except UserError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def _train_until_the_first_step(environment: str) -> str:
    """`train` on the tiny model with the Python tool: what stops it (it must stop before building the actor)."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from megatron_rlvr.trainer import Parts, train

    def built(cfg):
        raise AssertionError("the actor was built: the run did not stop before its first step")

    with tempfile.TemporaryDirectory(prefix="rlvr-unprivileged-") as work:
        hf_dir = make_tiny_hf_model("qwen2", os.path.join(work, "model"), seed=1)
        cfg = load_config(
            None,
            [
                f"model.hf_dir={hf_dir}",
                f"environment.name={environment}",
                "rollout.max_new_tokens=6",
                "rollout.max_model_len=64",
                "data.max_prompt_tokens=48",
                "data.demo_train_problems=8",
                "trainer.eval_every=0",
                f"trainer.output_dir={work}/out",
            ],
        )
        return _refusal(lambda: train(cfg, Parts(actor=built)))


def refused(payload: dict) -> dict:
    from megatron_rlvr.environments.host import EnvironmentHost
    from megatron_rlvr.rewards.containment import check_run_containment

    info = sandbox_info()
    accepted = run_python("import os\nprint(os.getuid())", "", SandboxLimits(accept_rlimits_only=True))
    return {
        "isolation": info.isolation,
        "code_run": _refusal(lambda: check_run_containment(RewardConfig(), ["math", "code"], "")),
        "math_run": repr(check_run_containment(RewardConfig(), ["math", "countdown"], "")),
        "accepted_run": repr(check_run_containment(RewardConfig(sandbox_accept_rlimits_only=True), ["code"], "")),
        "tool_host": _refusal(lambda: EnvironmentHost(EnvironmentConfig(name="python_tool"), RewardConfig())),
        "sandbox": _refusal(lambda: run_python("print(1)")),
        "accepted": {"isolation": accepted.isolation, "stdout": accepted.stdout, "returncode": accepted.returncode},
    }


def delegated(payload: dict) -> dict:
    """Many processes holding more memory than the budget, where root delegated a memory cgroup directory to us."""
    from megatron_rlvr.rewards import cgroup

    os.environ[cgroup.PARENT_ENV] = payload["cgroup_parent"]  # the directory root made for this test
    run = run_python(memory_by_many_processes(6, 64), "", LIMITS)
    return {"isolation": run.isolation, "memory": run.memory, "stdout": run.stdout, "oom_kills": run.oom_kills}


def train_refused(payload: dict) -> dict:
    return {"train": _train_until_the_first_step(payload["environment"])}


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    modes = {"contained": contained, "refused": refused, "train": train_refused, "delegated": delegated}
    print(json.dumps(modes[request["mode"]](request)))
