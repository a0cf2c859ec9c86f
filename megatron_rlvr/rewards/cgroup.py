"""One memory budget for a sandboxed program and every process it starts: a memory cgroup per sandbox.

RLIMIT_AS bounds one process; a program that forks N children holds N times that. A memory cgroup bounds their sum:
when the group reaches its limit the kernel's OOM killer picks a victim *inside the group* (one of the program's
processes), never the trainer. This module makes them on the cgroup v1 memory controller (the hierarchy mounted with
the ``memory`` option, usually /sys/fs/cgroup/memory), under ``<mount>/megatron_rlvr/<pid>.<start time>-<n>``:

- `memory_cgroup_parent()` says whether we may (the controller mounted, a child can be made and limited: as root,
  or as a user the ``megatron_rlvr`` directory was delegated to, i.e. made and chowned to it by root; another
  name in $MEGATRON_RLVR_CGROUP_PARENT); probed once per process, which also removes the groups left by processes
  that died (a SIGKILLed pool worker);
- `MemoryCgroup.create(limit)` makes one with ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, so
  swap cannot extend it); the sandbox's program child joins it by writing ``0`` into ``cgroup.procs`` before exec;
- `MemoryCgroup.remove()` kills whatever is still in it and removes it (also after timeouts and crashes).

cgroup v2 (a unified hierarchy with the memory controller) is not handled here: there the sandbox falls back to
rlimits sized so that address space x processes stays within the budget, and says so.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PARENT_NAME = "megatron_rlvr"  # the directory under the controller's mount our groups go under, by default
PARENT_ENV = "MEGATRON_RLVR_CGROUP_PARENT"  # another name for it: a directory root delegated under that name
_counter = itertools.count()
_name_lock = threading.Lock()
_probe_lock = threading.Lock()
_probed = False
_parent: Path | None = None
_reason = ""


def _memory_mount() -> Path | None:
    """The mount point of the cgroup v1 hierarchy that carries the memory controller, if any."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = right.split()
                if len(fields) >= 3 and fields[0] == "cgroup" and "memory" in fields[2].split(","):
                    return Path(left.split()[4].replace("\\040", " "))
    except OSError:
        return None
    return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tag() -> str:
    """This process as ``<pid>.<start time>``: unlike the pid alone, never the same for a later process."""
    return f"{os.getpid()}.{_start_time(os.getpid())}"


def owner_gone(tag: str) -> bool:
    """Whether the process ``tag`` names has ended (a malformed tag is never ours to remove: False)."""
    pid, _, start = tag.partition(".")
    return pid.isdigit() and bool(start) and _start_time(int(pid)) != start


def _sweep_stale(parent: Path) -> None:
    """Remove the groups of processes that died without cleaning up (their names start with the owner's tag); a
    user the directory is delegated to removes its own only."""
    uid = os.geteuid()
    for child in parent.iterdir():
        if child.is_dir() and owner_gone(child.name.split("-", 1)[0]) and uid in (0, child.stat().st_uid):
            MemoryCgroup(child).remove()


def memory_cgroup_parent() -> Path | None:
    """The directory our per-sandbox memory cgroups go under, or None when the kernel or our rights offer none."""
    global _probed, _parent, _reason
    with _probe_lock:
        if _probed:
            return _parent
        _probed = True
        mount = _memory_mount()
        if mount is None:
            _reason = "no cgroup v1 memory controller mounted (cgroup v2 is not supported)"
        else:
            parent = mount / (os.environ.get(PARENT_ENV) or PARENT_NAME)
            try:
                parent.mkdir(exist_ok=True)
                probe = MemoryCgroup.create(64 << 20, parent=parent)
                probe.remove()
                _sweep_stale(parent)
                _parent = parent
            except OSError as exc:
                if os.geteuid() != 0 and exc.errno in (errno.EACCES, errno.EPERM):
                    _reason = f"not root, and {parent} is not delegated to uid {os.geteuid()}"
                else:
                    _reason = f"cannot make a memory cgroup under {parent}: {exc}"
        return _parent


def unavailable_reason() -> str:
    """Why `memory_cgroup_parent()` is None ("" when it is not)."""
    memory_cgroup_parent()
    return _reason


class MemoryCgroup:
    """One cgroup v1 memory group: its limit covers every process in it, together."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, limit_bytes: int, parent: Path | None = None) -> MemoryCgroup:
        parent = parent or memory_cgroup_parent()
        if parent is None:
            raise OSError(errno.ENOENT, f"no memory cgroup hierarchy: {_reason}")
        with _name_lock:
            name = f"{owner_tag()}-{next(_counter)}"
        group = cls(parent / name)
        group.path.mkdir()
        try:
            # the memory limit first: the kernel refuses a memsw limit below it
            (group.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = group.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # only with swap accounting; then swap cannot stretch the budget
                memsw.write_text(str(limit_bytes))
        except OSError:
            group.remove()
            raise
        return group

    @property
    def procs_path(self) -> str:
        return str(self.path / "cgroup.procs")

    def _read_int(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def peak_bytes(self) -> int | None:
        """The most memory the group held at once since it was made."""
        return self._read_int("memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for reaching the limit."""
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL whatever is still in the group, then remove it; False (and a warning) if it would not go."""
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("could not remove the sandbox memory cgroup %s: %s", self.path, exc)
                    return False
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            time.sleep(pause)  # killed processes leave the group when they have exited
            pause = min(pause * 2, 0.05)
