"""The sandbox as an unprivileged user (a user this test creates), the GPU user's normal case under Slurm.

With user namespaces (most kernels), the hostile programs of tests/unit/rewards are contained through the code reward
and the Python tool as they are for root: the host's files, network and /tmp are out of reach, and the fork bomb,
the disk fill and the memory hogs stop at their budgets (rlimits, or a memory cgroup where root delegated one to the
user). With user namespaces turned off, a run that would execute
programs stops before its first step with one line naming the missing kernel feature and the key that accepts
rlimits-only containment; a run that executes none goes on, and so does one that accepted it.
"""

import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest

from megatron_rlvr.rewards import cgroup
from tests.unit.rewards.sandbox_helpers import sandbox_processes
from tests.unit.rewards.unprivileged import run_as, unprivileged_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making a user takes root (as non-root, every test is this)")


@pytest.fixture(scope="module")
def user():
    with unprivileged_user() as made:
        yield made
        for path in _user_files(made.pw_uid, "*"):  # what else it left (torch's compile cache)
            shutil.rmtree(path, ignore_errors=True)


def _user_files(uid: int, pattern: str = "rlvr-*") -> list[str]:
    """What ``uid`` left in the host's /tmp (its sandboxes' dirs, a model it wrote): there must be nothing."""
    return [str(p) for p in Path("/tmp").glob(pattern) if p.lstat().st_uid == uid]


def _user_processes(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_hostile_programs_are_contained_for_an_unprivileged_user(user):
    secret = uuid.uuid4().hex
    secret_path = Path("/tmp") / f"rlvr_tests_{uuid.uuid4().hex}.json"  # its name is in the error the tool returns
    write_path = Path("/tmp") / f"rlvr_pwned_{secret}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    try:
        secret_path.write_text(secret)
        os.chmod(secret_path, 0o644)  # readable by any user: only the sandbox's filesystem view keeps it out
        payload = {
            "mode": "contained",
            "secret": secret,
            "secret_path": str(secret_path),
            "port": listener.getsockname()[1],
            "write_path": str(write_path),
        }
        seen = run_as(user, "tests.unit.rewards.hostile_as_user", payload)
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the host's loopback
        assert not write_path.exists()
    finally:
        listener.close()
        secret_path.unlink(missing_ok=True)
        write_path.unlink(missing_ok=True)
    assert seen["uid"] == user.pw_uid and seen["isolation"] == "user-namespaces", seen
    assert seen["memory"] == "rlimits", seen  # no cgroup for this user: address space x processes carry the budget
    reward, tool = seen["reward"], seen["tool"]
    for name, run in reward.items():  # each scores 0, except the write: it wrote, but into its own /tmp
        assert run["score"] == (name == "write") and run["isolation"] == "user-namespaces", (name, run)
    assert secret not in reward["read"]["stdout"] and "FileNotFoundError" in reward["read"]["stderr"], reward["read"]
    assert "connected" not in reward["connect"]["stdout"] and reward["connect"]["returncode"] != 0, reward["connect"]
    assert "wrote" in reward["write"]["stdout"] and "wrote" in tool["write"]  # the host's /tmp kept nothing
    assert int(reward["fork_bomb"]["stdout"]) < 16, reward["fork_bomb"]
    written, fs_mb = map(int, reward["disk_fill"]["stdout"].split()[-2:])
    assert "No space left" in reward["disk_fill"]["stdout"] and fs_mb == 64 and written <= 64, reward["disk_fill"]
    assert int(reward["memory_by_processes"]["stdout"]) * 64 < 256, reward["memory_by_processes"]
    assert "MemoryError" in reward["memory_hog"]["stderr"], reward["memory_hog"]
    # the same programs through the Python tool (its first observation says each call is a fresh interpreter)
    assert secret not in tool["read"] and "FileNotFoundError" in tool["read"], tool["read"]
    assert "connected" not in tool["connect"], tool["connect"]
    assert int(tool["fork_bomb"]) < 16, tool["fork_bomb"]
    written, fs_mb = map(int, tool["disk_fill"].split()[-2:])
    assert "No space left" in tool["disk_fill"] and fs_mb == 64 and written <= 64, tool["disk_fill"]
    assert int(tool["memory_by_processes"]) * 64 < 256 and "MemoryError" in tool["memory_hog"], tool
    assert _user_processes(user.pw_uid) == [] and sandbox_processes() == [] and _user_files(user.pw_uid) == []


@pytest.mark.skipif(cgroup._memory_mount() is None, reason="no cgroup v1 memory controller here")
def test_a_delegated_memory_cgroup_holds_the_budget_of_all_processes(user):
    parent = cgroup._memory_mount() / f"megatron_rlvr_delegated_{os.getpid()}"
    parent.mkdir()
    try:
        os.chown(parent, user.pw_uid, user.pw_gid)  # delegated: the user may make groups under it
        seen = run_as(user, "tests.unit.rewards.hostile_as_user", {"mode": "delegated", "cgroup_parent": parent.name})
    finally:
        for group in parent.iterdir() if parent.exists() else []:
            if group.is_dir():
                cgroup.MemoryCgroup(group).remove()
        parent.rmdir()
    assert seen["isolation"] == "user-namespaces" and seen["memory"] == "cgroup", seen
    assert seen["oom_kills"] >= 1 and int(seen["stdout"]) < 6, seen  # 6 x 64 MB against one budget of 256 MB


def _the_one_line(message: str) -> None:
    assert message.startswith("SandboxUnavailableError: code sandbox: no isolation can be had here"), message
    assert "user namespaces are turned off (/proc/sys/user/max_user_namespaces = 0)" in message, message
    assert "reward.sandbox_accept_rlimits_only=true" in message and "\n" not in message, message


def test_without_user_namespaces_a_run_that_executes_programs_stops_before_its_first_step(user):
    seen = run_as(user, "tests.unit.rewards.hostile_as_user", {"mode": "refused"}, user_namespaces=False)
    assert seen["isolation"] == "rlimits-only", seen
    for where in ("code_run", "tool_host", "sandbox"):  # the run's start, the tool's workers' start, a program
        _the_one_line(seen[where])
    assert "rows of task 'code'" in seen["code_run"] and "environment.name=python_tool" in seen["tool_host"], seen
    assert seen["math_run"] == "None", seen  # no program in the run: nothing to stop
    assert "isolation='rlimits-only'" in seen["accepted_run"], seen
    assert seen["accepted"] == {"isolation": "rlimits-only", "stdout": f"{user.pw_uid}\n", "returncode": 0}, seen
    assert _user_processes(user.pw_uid) == [] and _user_files(user.pw_uid) == []


@pytest.mark.slow
def test_without_user_namespaces_the_trainer_stops_before_building_the_actor(user):
    seen = run_as(
        user,
        "tests.unit.rewards.hostile_as_user",
        {"mode": "train", "environment": "python_tool"},
        user_namespaces=False,
    )
    _the_one_line(seen["train"])
    assert seen["train"].endswith("(this run executes them: environment.name=python_tool)"), seen
    assert _user_files(user.pw_uid) == []
