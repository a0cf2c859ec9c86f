"""The host half of one sandbox: lay out its directory, start `sandbox_launcher.py` with the chosen isolation, wait,
read back each run's status and output, and clean up whatever it left (its processes, memory cgroup and files).

Which isolation to ask for is `sandbox.py`'s decision (what this process can have); this module only carries it out:
- ``namespaces`` (root): the launcher's mount/PID/network/IPC/UTS namespaces and a fresh unprivileged uid per run;
- ``user-namespaces`` (not root): the same namespaces inside a user namespace of the launcher's own, the program as
  uid `INSIDE_ID` there (this user outside), with no capabilities. Root gets it only where it may not make
  namespaces directly; its program is then uid 0 outside, which the kernel exempts from RLIMIT_NPROC;
- ``none``: a throw-away work dir on the host, and a fresh uid per run when we are root (``uid+rlimits``) or this
  user's (``rlimits-only``).
The memory budget is one memory cgroup for all of the program's processes when ``memory_cgroup`` is set, else
rlimits sized so that address space x processes stays within it (`memory_limits`).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.rewards.cgroup import MemoryCgroup, owner_gone, owner_tag

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_SETUP_FAILED = 125
UID_BASE = 300_000  # the per-run uids (root only): UID_BASE .. UID_BASE + 20_000 * 64
INSIDE_ID = 1000  # the program's uid and gid inside a user namespace (not 0: execve then drops every capability)
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
MIN_PROCESS_MB = 128  # the least address space a process gets when rlimits alone carry the memory budget
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# in a user namespace RLIMIT_NPROC counts every process of the namespace's one uid: the launcher and its init too
_USERNS_SUPERVISORS = 2


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the program's fault)."""


@dataclass
class SandboxLimits:
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    nproc: int = 32
    nofile: int = 64
    tmpfs_mb: int = 64  # the private tmpfs (work dir, /tmp, /dev/shm) with namespaces; it is RAM, not disk
    output_chars: int = 1 << 20  # stdout/stderr returned to the caller, each
    # run programs without namespaces where none can be had (rlimits, and a per-run uid when root), instead of
    # refusing; ``reward.sandbox_accept_rlimits_only``
    accept_rlimits_only: bool = False


@dataclass
class SandboxResult:
    returncode: int  # 128 + signal when killed by one
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "namespaces", "user-namespaces", "uid+rlimits" or "rlimits-only" (see sandbox.py)
    memory: str = "rlimits"  # "cgroup": one memory budget for all its processes; "rlimits": per process
    memory_peak_mb: float | None = None  # the sandbox's peak memory (cgroup only; all runs of the sandbox)
    oom_kills: int = 0  # its processes the kernel killed at the memory budget (cgroup only)


def python_prefix() -> str:
    return os.path.realpath(sys.base_prefix)


def python_executable() -> str:
    """The base interpreter (not a venv shim, whose pyvenv.cfg may be unreachable inside the sandbox)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = os.path.join(sys.base_prefix, "bin", version)
    return os.path.realpath(candidate if os.path.exists(candidate) else sys.executable)


def system_dirs() -> list[str]:
    """What the program's root shows, read-only: the system's binaries and libraries and the interpreter's prefix."""
    dirs = [d for d in _SYSTEM_DIRS if os.path.lexists(d)]
    for extra in (python_prefix(), os.path.dirname(os.path.dirname(python_executable()))):
        real = [os.path.realpath(d) for d in dirs]
        if extra == "/":  # an interpreter installed at / would bring the whole host along
            raise SandboxError("the Python interpreter's prefix is /: the sandbox cannot show it without the host")
        if not any(extra == d or extra.startswith(d.rstrip("/") + "/") for d in real):
            dirs.append(extra)
    return dirs


def memory_limits(limits: SandboxLimits, cgroup: bool) -> tuple[int, int]:
    """(RLIMIT_AS bytes per process, processes) that keep the whole program within ``limits.memory_mb``.

    With a memory cgroup the group holds the budget for all processes together, and each process keeps the whole
    budget as its address space (a single huge allocation then fails with MemoryError instead of an OOM kill).
    Without one, address space x processes must fit the budget: fewer processes, each with an equal share, at least
    `MIN_PROCESS_MB` (what a CPython process doing ordinary work needs).
    """
    mb = 1024 * 1024
    if cgroup:
        return limits.memory_mb * mb, limits.nproc
    nproc = max(1, min(limits.nproc, limits.memory_mb // MIN_PROCESS_MB))
    return limits.memory_mb * mb // nproc, nproc


def run_uids(pid: int) -> range:
    """The per-run uids the sandboxes of process ``pid`` take (root only): a block of 64 of its own, distinct per
    process, so concurrent runs never share an RLIMIT_NPROC count or signal each other."""
    first = UID_BASE + (pid % 20_000) * 64
    return range(first, first + 64)


def _next_uid() -> int:
    with _uid_lock:
        return run_uids(os.getpid())[next(_uid_counter) % 64]  # distinct per run too


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (it is ours alone): catches anything that left the process group."""
    for _ in range(3):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    uid_line = next(line for line in f if line.startswith("Uid:"))
                if int(uid_line.split()[1]) == uid:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, StopIteration, ValueError):
                continue
        if not found:
            return


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def sweep_stale_dirs() -> None:
    """Remove the host dirs of sandboxes whose scoring process was killed mid-run (a pool worker at its deadline)."""
    for path in Path(tempfile.gettempdir()).glob("rlvr-sandbox-*-*"):
        if owner_gone(path.name.split("-")[2]):
            shutil.rmtree(path, ignore_errors=True)


def launch(
    source: str,
    stdins: list[str],
    limits: SandboxLimits,
    *,
    isolation: str,
    per_run_uid: bool,
    memory_cgroup: bool,
    label: str,
) -> list[SandboxResult]:
    """Run ``source`` once per stdin in one sandbox of ``isolation`` ("namespaces", "user-namespaces" or "none"),
    stopping after the first nonzero exit or timeout; ``label`` is what its results call the isolation.

    ``per_run_uid``: the program gets a fresh unprivileged uid (root only). Raises `SandboxError` when the sandbox
    could not be set up; never for the program's behaviour.
    """
    namespaces = isolation != "none"
    uid = _next_uid() if per_run_uid else None
    root = Path(tempfile.mkdtemp(prefix=f"rlvr-sandbox-{owner_tag()}-"))
    process = None
    cgroup = None
    try:
        os.chmod(root, 0o711)  # without namespaces the program traverses to its work dir but may not list ours
        io_dir, new_root = root / "io", root / "root"
        io_dir.mkdir(mode=0o700)
        new_root.mkdir()
        (io_dir / "main.py").write_text(source, encoding="utf-8")
        if namespaces:
            work_dir, tmp_dir = "/sandbox/work", "/tmp"
        else:  # the host's view: a work dir of our own, the program's only writable place
            work = root / "work"
            work.mkdir(mode=0o700)
            if uid is not None:
                os.chown(work, uid, uid)
            work_dir = tmp_dir = str(work)
        for i, stdin in enumerate(stdins):
            (io_dir / f"stdin-{i}").write_text(stdin, encoding="utf-8")
        if memory_cgroup:
            cgroup = MemoryCgroup.create(limits.memory_mb * 1024 * 1024)
        as_bytes, nproc = memory_limits(limits, cgroup is not None)
        if isolation == "user-namespaces":
            owner = INSIDE_ID
            nproc += _USERNS_SUPERVISORS
        else:
            owner = 0 if uid is None else uid
        cfg = {
            "isolation": isolation,
            "parent_pid": os.getpid(),
            "io_dir": str(io_dir),
            "new_root": str(new_root),
            "work_dir": work_dir,
            "tmp_dir": tmp_dir,
            "runs": len(stdins),
            "wall_s": limits.wall_s,
            "python": python_executable(),
            "system_dirs": system_dirs(),
            "tmpfs_mb": limits.tmpfs_mb,
            "tmpfs_inodes": max(1024, limits.tmpfs_mb * 256),
            "cgroup_procs": cgroup.procs_path if cgroup is not None else None,
            "uid": uid,
            "owner": owner,
            "limits": {
                "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                "as_bytes": as_bytes,
                "file_size_mb": limits.file_size_mb,
                "nproc": nproc,
                "nofile": limits.nofile,
            },
        }
        config_path = io_dir / "config.json"
        config_path.write_text(json.dumps(cfg))
        with open(io_dir / "launcher.err", "wb") as launcher_err:
            process = subprocess.Popen(
                [python_executable(), "-I", "-S", str(_LAUNCHER), str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=launcher_err,
                start_new_session=True,
                close_fds=True,
                cwd=str(root),
            )
            backstop_hit = False
            try:  # the launcher enforces each run's wall time; this only backs it up
                launcher_status = process.wait(timeout=limits.wall_s * len(stdins) + 2.0)
            except subprocess.TimeoutExpired:
                backstop_hit = True
                launcher_status = None
        setup_error = _read_capped(io_dir / "launcher.err", limits.output_chars)
        if launcher_status == _SETUP_FAILED and "sandbox setup failed" in setup_error:
            raise SandboxError(setup_error.strip())
        try:
            statuses = json.loads((io_dir / "results.json").read_text())
        except (OSError, json.JSONDecodeError):
            statuses = []
        peak = cgroup.peak_bytes() if cgroup is not None else None
        memory = dict(
            memory="cgroup" if cgroup is not None else "rlimits",
            memory_peak_mb=None if peak is None else peak / 2**20,
            oom_kills=cgroup.oom_kills() if cgroup is not None else 0,
        )
        results = []
        for i, status in enumerate(statuses):
            stderr = _read_capped(io_dir / f"stderr-{i}", limits.output_chars)
            if status["returncode"] == _SETUP_FAILED and stderr.startswith("sandbox setup failed"):
                raise SandboxError(stderr.strip())
            results.append(
                SandboxResult(
                    returncode=status["returncode"],
                    stdout=_read_capped(io_dir / f"stdout-{i}", limits.output_chars),
                    stderr=stderr,
                    timed_out=status["timed_out"],
                    isolation=label,
                    **memory,
                )
            )
        if (
            backstop_hit
            or not results
            or (len(results) < len(stdins) and results[-1].returncode == 0 and not results[-1].timed_out)
        ):
            # the launcher died or overran before reporting this run: it counts as a timeout
            results.append(
                SandboxResult(
                    returncode=-signal.SIGKILL,
                    stdout="",
                    stderr=setup_error,
                    timed_out=True,
                    isolation=label,
                    **memory,
                )
            )
        return results
    finally:
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        if uid is not None:
            _kill_uid(uid)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)
