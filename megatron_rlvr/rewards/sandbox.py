"""Run an untrusted Python program in a sandbox and return its exit status and (capped) output.

What contains it (`sandbox_run.py` is the host half of one sandbox, `sandbox_launcher.py` the inside half):
- a new session/process group, and new mount, network, PID, IPC and UTS namespaces: no network at all (a private
  loopback that is down), a private /proc; when the program ends or is killed, its PID namespace dies with
  everything in it. As root (or with CAP_SYS_ADMIN) they are made directly (``namespaces``); otherwise inside an
  unprivileged user namespace of the sandbox's own (``user-namespaces``), where the program is one unprivileged uid
  with no capabilities and may make no user namespace of its own;
- a root of its own: the system's binaries and libraries (/usr, /lib*, /bin, /sbin) and the interpreter's prefix,
  read-only; a minimal /dev (null, zero, full, random, urandom) and /etc (passwd, group, hosts, ld.so.cache); and
  one private tmpfs of ``tmpfs_mb`` as its work dir, /tmp and /dev/shm, the only writable place. The host's /tmp,
  /dev/shm, data, outputs and home directories do not exist for it, and what it writes is capped by the tmpfs's
  size and inode count and is gone with its mount namespace;
- one memory budget for the whole program, all its processes together: a memory cgroup per sandbox (`cgroup.py`)
  where one can be made (root, or a hierarchy delegated to this user), so the OOM killer, if it comes, picks inside
  the group; otherwise rlimits sized so that address space x processes stays within the budget;
- as root, a fresh unprivileged uid per run: it can neither write root's files nor signal any process but its own;
  in a user namespace its uid is the namespace's alone. Either way RLIMIT_NPROC counts only its processes, so a
  fork bomb stops at ``nproc``;
- rlimits: CPU seconds, address space, file size (also caps stdout/stderr), process count, open files, no core;
- a wall timeout, after which the whole process group is SIGKILLed and, when root, every process of the run's uid;
  the launcher also dies with the process that started it (a pool worker killed at its deadline).

Where no namespaces can be had at all (user namespaces turned off, as on some clusters), there is no isolation:
a program would run with the host's files and network. It is refused (`SandboxUnavailableError`, one line naming
the missing kernel feature) unless the caller accepts rlimits-only containment (``SandboxLimits.accept_rlimits_only``,
``reward.sandbox_accept_rlimits_only``); then it runs with rlimits, the memory cgroup when one can be made, and the
uid drop when we are root and the interpreter is reachable by other users, in a throw-away work dir on the host,
after a loud warning once per process. `sandbox_info()` says which containment is in force here and
`SandboxResult.isolation` / ``.memory`` record it.

No extra package is needed: namespaces and mounts come from libc through ctypes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards.cgroup import memory_cgroup_parent, unavailable_reason
from megatron_rlvr.rewards.sandbox_run import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    launch,
    memory_limits,
    python_executable,
    python_prefix,
    sweep_stale_dirs,
)

__all__ = [
    "ACCEPT_KEY",
    "SandboxError",
    "SandboxInfo",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "run_python",
    "run_python_many",
    "reset_warnings",
    "sandbox_info",
    "use_containment",
]

log = logging.getLogger(__name__)

ACCEPT_KEY = "reward.sandbox_accept_rlimits_only"  # the one config key that accepts a sandbox without namespaces
ISOLATED = ("namespaces", "user-namespaces")
_PROBE_LIMITS = SandboxLimits(cpu_s=10, wall_s=30, memory_mb=256, nproc=4, tmpfs_mb=1)
_probe_lock = threading.Lock()
_probed: dict[str, str] = {}  # isolation -> "" when a test program ran in it here, else why it did not
_forced: dict[str, str] = {}  # use_containment's choice for this process
_warned = False
_logged = False


class SandboxUnavailableError(ConfigError):
    """No namespaces can be had here and the caller did not accept rlimits-only containment."""


def _probe(isolation: str) -> str:
    """'' when a sandbox with ``isolation`` runs a test program here, else why not (probed once per process)."""
    with _probe_lock:
        if isolation not in _probed:
            try:
                result = launch(
                    "print('ok')",
                    [""],
                    _PROBE_LIMITS,
                    isolation=isolation,
                    per_run_uid=isolation == "namespaces",
                    memory_cgroup=False,
                    label=isolation,
                )[0]
                failed = result.returncode != 0 or result.stdout.strip() != "ok"
                why = f"a test program exited {result.returncode}: {result.stderr.strip()[-300:]}" if failed else ""
            except (SandboxError, OSError) as exc:
                why = str(exc).replace("sandbox setup failed: ", "")[:300]
            _probed[isolation] = why
        return _probed[isolation]


def _read_sysctl(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _missing_user_namespaces(error: str) -> str:
    """The kernel feature that keeps an unprivileged process out of user namespaces here, as the host names it."""
    if _read_sysctl("/proc/sys/user/max_user_namespaces") == "0":
        return "user namespaces are turned off (/proc/sys/user/max_user_namespaces = 0)"
    if _read_sysctl("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return "unprivileged user namespaces are turned off (/proc/sys/kernel/unprivileged_userns_clone = 0)"
    if _read_sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return (
            "AppArmor keeps unprivileged user namespaces from mounting "
            "(/proc/sys/kernel/apparmor_restrict_unprivileged_userns = 1)"
        )
    return f"unprivileged user namespaces do not work here ({error})"


def _isolation_here() -> tuple[str, str]:
    """(the strongest isolation that works in this process, why nothing stronger does)."""
    reasons = []
    if os.geteuid() == 0:
        why = _probe("namespaces")
        if not why:
            return "namespaces", ""
        reasons.append(f"mount/PID/network namespaces are refused to root ({why})")
    why = _probe("user-namespaces")
    if not why:
        return "user-namespaces", "; ".join(reasons)
    reasons.append(_missing_user_namespaces(why))
    return "none", "; ".join(reasons)


def _interpreter_reachable_by_others() -> bool:
    """Whether an unprivileged uid could exec the interpreter and read its library (every directory o+x)."""
    paths = [Path(python_executable()), Path(python_prefix()) / "lib"]
    for path in paths:
        for directory in [*path.parents, path]:
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
    return True


@dataclass(frozen=True)
class SandboxInfo:
    """Which containment is in force in this process (it depends on the kernel and on being root)."""

    isolation: str  # "namespaces", "user-namespaces", "uid+rlimits" or "rlimits-only"
    filesystem: str  # "private-root" (a read-only root of system dirs + a capped tmpfs) or "host"
    memory: str  # "cgroup" (one budget for all processes) or "rlimits" (address space x processes <= budget)
    isolation_reason: str = ""  # why no stronger isolation is in force ("" when none is missing)
    memory_reason: str = ""  # why the memory budget is not a cgroup ("" when it is)

    @property
    def reason(self) -> str:
        """Why a weaker form is in force ("" when the strongest is)."""
        return "; ".join(r for r in (self.isolation_reason, self.memory_reason) if r)

    @property
    def isolated(self) -> bool:
        """Whether programs get namespaces and a private root (not the host's files and network)."""
        return self.isolation in ISOLATED

    def describe(self, limits: SandboxLimits | None = None) -> str:
        limits = limits or SandboxLimits()
        as_bytes, nproc = memory_limits(limits, self.memory == "cgroup")
        memory = (
            f"memory cgroup of {limits.memory_mb} MB for all its processes (each also RLIMIT_AS {limits.memory_mb} MB)"
            if self.memory == "cgroup"
            else f"rlimits: {nproc} processes x {as_bytes >> 20} MB address space"
        )
        filesystem = (
            f"a private read-only root with a {limits.tmpfs_mb} MB tmpfs as work dir, /tmp and /dev/shm, no network"
            if self.filesystem == "private-root"
            else "the host filesystem (writable: its work dir only) and the host's network"
        )
        text = f"code sandbox: {self.isolation}; {filesystem}; {memory}"
        return text + (f" ({self.reason})" if self.reason else "")

    def refusal(self) -> str:
        """The one line that stops a run which would execute programs here without isolation."""
        who = "a per-run uid" if self.isolation == "uid+rlimits" else "this user"
        return (
            f"code sandbox: no isolation can be had here: {self.isolation_reason}. Programs the "
            f"policy writes (code rewards, the Python tool) would run as {who} with this host's files and network; "
            f"enable user namespaces, or set {ACCEPT_KEY}=true (megatron-rlvr eval: --sandbox-accept-rlimits-only) to "
            "accept rlimits-only containment (docs/sandbox.md)"
        )


def sandbox_info() -> SandboxInfo:
    """The containment `run_python` applies here (probed once per process; `use_containment` may weaken it)."""
    isolation, reason = _isolation_here()
    forced = _forced.get("isolation")
    if forced is not None and forced != isolation:
        if forced != "none" and _probe(forced):
            raise SandboxError(f"use_containment({forced!r}): not available here ({_probe(forced)})")
        isolation, reason = forced, f"{forced} chosen by use_containment"
    if isolation == "none":
        root = os.geteuid() == 0
        isolation = "uid+rlimits" if root and _interpreter_reachable_by_others() else "rlimits-only"
    cgroup = memory_cgroup_parent() is not None and _forced.get("memory") != "rlimits"
    return SandboxInfo(
        isolation=isolation,
        filesystem="private-root" if isolation in ISOLATED else "host",
        memory="cgroup" if cgroup else "rlimits",
        isolation_reason=reason,
        memory_reason="" if cgroup else f"no memory cgroup: {unavailable_reason() or 'rlimits by use_containment'}",
    )


@contextlib.contextmanager
def use_containment(isolation: str | None = None, memory: str | None = None) -> Iterator[None]:
    """Run this process's sandboxes with a weaker containment than the strongest one here, for comparisons
    (``isolation``: "user-namespaces" or "none"; ``memory``: "rlimits"). Not for runs: `sandbox_info` picks those."""
    if isolation not in (None, "namespaces", "user-namespaces", "none") or memory not in (None, "rlimits"):
        raise ValueError(f"use_containment: unknown isolation {isolation!r} or memory {memory!r}")
    saved = dict(_forced)
    _forced.update({k: v for k, v in (("isolation", isolation), ("memory", memory)) if v is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def check_isolation(accept_rlimits_only: bool) -> SandboxInfo:
    """The containment in force here; `SandboxUnavailableError` (one line: the missing kernel feature and
    `ACCEPT_KEY`) when it has no namespaces and rlimits-only containment was not accepted."""
    info = sandbox_info()
    if not info.isolated and not accept_rlimits_only:
        raise SandboxUnavailableError(info.refusal())
    return info


def reset_warnings() -> None:
    """Forget that the warning about a sandbox without namespaces was given: the next such run warns again."""
    global _warned
    _warned = False


def _log_once(info: SandboxInfo, limits: SandboxLimits) -> None:
    global _warned, _logged
    if not _logged:
        _logged = True
        log.info("%s", info.describe(limits))
        sweep_stale_dirs()
    if not info.isolated and not _warned:
        _warned = True
        log.warning(
            "!" * 20 + " %s " + "!" * 20,
            "code sandbox WITHOUT namespaces (accepted by "
            + ACCEPT_KEY
            + "): no network isolation and no private read-only filesystem "
            + (
                "(a per-run uid and rlimits only)"
                if info.isolation == "uid+rlimits"
                else "(rlimits only: programs run as THIS user and can touch its files and processes!)"
            ),
        )


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``source`` as ``main.py`` with ``stdin`` in a fresh sandbox; never raises for the program's behaviour."""
    return run_python_many(source, [stdin], limits)[0]


def run_python_many(source: str, stdins: list[str], limits: SandboxLimits | None = None) -> list[SandboxResult]:
    """Run ``source`` once per stdin in one sandbox (one setup), stopping after the first nonzero exit or timeout.

    Returns one result per run made (fewer than ``stdins`` when it stopped early); ``limits`` apply to each run.
    Raises `SandboxUnavailableError` where no namespaces can be had and ``limits.accept_rlimits_only`` is off.
    """
    if not stdins:
        raise ValueError("run_python_many: give at least one stdin")
    limits = limits or SandboxLimits()
    info = check_isolation(limits.accept_rlimits_only)
    _log_once(info, limits)
    return launch(
        source,
        stdins,
        limits,
        isolation=info.isolation if info.isolated else "none",
        per_run_uid=info.isolation in ("namespaces", "uid+rlimits"),
        memory_cgroup=info.memory == "cgroup",
        label=info.isolation,
    )
