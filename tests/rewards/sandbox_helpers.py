"""Shared pieces of the sandbox tests: small limits, and finding what a sandbox might have left on the host."""

import os
from pathlib import Path

from megatron_rlvr.rewards import cgroup
from megatron_rlvr.rewards.sandbox import _UID_BASE, SandboxLimits

LIMITS = SandboxLimits(cpu_s=2, wall_s=5, memory_mb=512, nproc=16)
_UID_END = _UID_BASE + 20_000 * 64  # the range of the per-run uids (sandbox._next_uid)


def sandbox_processes() -> list[int]:
    """Host processes of a sandbox: a per-run uid, or a cwd in a sandbox dir (there must be none after a run)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            if _UID_BASE <= uid < _UID_END or "rlvr-sandbox-" in os.readlink(f"/proc/{entry}/cwd"):
                found.append(int(entry))
        except (OSError, StopIteration, ValueError):
            pass
    return found


def leftovers(pid: int | None = None) -> list[str]:
    """Memory cgroups and host work dirs of ``pid``'s sandboxes (default: this process) still present."""
    pid = os.getpid() if pid is None else pid
    found = [str(p) for p in Path("/tmp").glob(f"rlvr-sandbox-{pid}.*")]
    parent = cgroup.memory_cgroup_parent()
    if parent is not None:
        found += [str(p) for p in parent.glob(f"{pid}.*")]
    return found


def io_reference(expected: str, stdin: str = "") -> dict:
    return {"io": [{"input": stdin, "output": expected}]}
