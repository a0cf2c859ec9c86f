"""Run an untrusted Python program in a sandbox and return its exit status and (capped) output.

What contains it (see `sandbox_launcher.py` for the inside half):
- a new session/process group, and, when the kernel allows (root, or CAP_SYS_ADMIN), new mount, network, PID, IPC
  and UTS namespaces: no network at all (a private loopback that is down), a private /proc; when the program ends
  or is killed, its PID namespace dies with everything in it;
- with namespaces, a root of its own: the system's binaries and libraries (/usr, /lib*, /bin, /sbin) and the
  interpreter's prefix, read-only; a minimal /dev (null, zero, full, random, urandom) and /etc (passwd, group,
  hosts, ld.so.cache); and one private tmpfs of ``tmpfs_mb`` as its work dir, /tmp and /dev/shm, the only writable
  place. The host's /tmp, /dev/shm, data, outputs and home directories do not exist for it, and what it writes is
  capped by the tmpfs's size and inode count and is gone with its mount namespace;
- one memory budget for the whole program, all its processes together: a memory cgroup per sandbox (`cgroup.py`)
  where the kernel offers one, so the OOM killer, if it comes, picks inside the group; otherwise rlimits sized so
  that address space x processes stays within the budget;
- a fresh unprivileged uid per run (when we are root): it can neither write root's files nor signal any process
  but its own, and RLIMIT_NPROC counts only its processes — a fork bomb stops at `nproc`;
- rlimits: CPU seconds, address space, file size (also caps stdout/stderr), process count, open files, no core;
- a wall timeout, after which the whole process group is SIGKILLed and, when root, every process of the run's uid;
  the launcher also dies with the process that started it (a pool worker killed at its deadline).
Without namespaces the run still has rlimits, the memory cgroup when root, and the uid drop when we are root and the
interpreter is reachable by other users (not under a 0700 home), but no network isolation and no private
filesystem (a throw-away work dir on the host is its writable place): this is logged as a loud warning once per
process. `sandbox_info()` says which containment is in force and `SandboxResult.isolation` / ``.memory`` record it.

No extra package is needed: namespaces and mounts come from libc through ctypes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.rewards.cgroup import MemoryCgroup, memory_cgroup_parent, owner_gone, owner_tag, unavailable_reason

log = logging.getLogger(__name__)

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_SETUP_FAILED = 125
_UID_BASE = 300_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
_MIN_PROCESS_MB = 128  # the least address space a process gets when rlimits alone carry the memory budget
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_probe_result: bool | None = None
_warned = False
_logged = False


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


@dataclass
class SandboxResult:
    returncode: int  # 128 + signal when killed by one
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "namespaces", "uid+rlimits" or "rlimits-only" (see the module docstring)
    memory: str = "rlimits"  # "cgroup": one memory budget for all its processes; "rlimits": per process
    memory_peak_mb: float | None = None  # the sandbox's peak memory (cgroup only; all runs of the sandbox)
    oom_kills: int = 0  # its processes the kernel killed at the memory budget (cgroup only)


def _python_prefix() -> str:
    return os.path.realpath(sys.base_prefix)


def _python_executable() -> str:
    """The base interpreter (not a venv shim, whose pyvenv.cfg may be unreachable inside the sandbox)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = os.path.join(sys.base_prefix, "bin", version)
    return os.path.realpath(candidate if os.path.exists(candidate) else sys.executable)


def namespaces_available() -> bool:
    """Whether this process may create the namespaces the sandbox uses (probed once, in a throw-away child)."""
    global _probe_result
    if _probe_result is None:
        if os.geteuid() != 0:
            _probe_result = False
        else:
            probe = (
                "import ctypes,sys;l=ctypes.CDLL(None,use_errno=True);"
                "sys.exit(0 if l.unshare(0x20000|0x40000000|0x20000000|0x8000000|0x4000000)==0 else 1)"
            )
            try:
                _probe_result = (
                    subprocess.run([_python_executable(), "-I", "-S", "-c", probe], timeout=30).returncode == 0
                )
            except (OSError, subprocess.TimeoutExpired):
                _probe_result = False
    return _probe_result


def _interpreter_reachable_by_others() -> bool:
    """Whether an unprivileged uid could exec the interpreter and read its library (every directory o+x)."""
    import stat

    paths = [Path(_python_executable()), Path(_python_prefix()) / "lib"]
    for path in paths:
        for directory in [*path.parents, path]:
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH:
                return False
    return True


def _next_uid() -> int:
    with _uid_lock:
        # distinct per process and per run, so concurrent runs never share an RLIMIT_NPROC count or signal each other
        return _UID_BASE + (os.getpid() % 20_000) * 64 + next(_uid_counter) % 64


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


def _system_dirs() -> list[str]:
    """What the program's root shows, read-only: the system's binaries and libraries and the interpreter's prefix."""
    dirs = [d for d in _SYSTEM_DIRS if os.path.lexists(d)]
    for extra in (_python_prefix(), os.path.dirname(os.path.dirname(_python_executable()))):
        real = [os.path.realpath(d) for d in dirs]
        if extra == "/":  # an interpreter installed at / would bring the whole host along
            raise SandboxError("the Python interpreter's prefix is /: the sandbox cannot show it without the host")
        if not any(extra == d or extra.startswith(d.rstrip("/") + "/") for d in real):
            dirs.append(extra)
    return dirs


def _memory_limits(limits: SandboxLimits, cgroup: bool) -> tuple[int, int]:
    """(RLIMIT_AS bytes per process, RLIMIT_NPROC) that keep the whole program within ``limits.memory_mb``.

    With a memory cgroup the group holds the budget for all processes together, and each process keeps the whole
    budget as its address space (a single huge allocation then fails with MemoryError instead of an OOM kill).
    Without one, address space x processes must fit the budget: fewer processes, each with an equal share, at least
    `_MIN_PROCESS_MB` (what a CPython process doing ordinary work needs).
    """
    mb = 1024 * 1024
    if cgroup:
        return limits.memory_mb * mb, limits.nproc
    nproc = max(1, min(limits.nproc, limits.memory_mb // _MIN_PROCESS_MB))
    return limits.memory_mb * mb // nproc, nproc


@dataclass(frozen=True)
class SandboxInfo:
    """Which containment is in force in this process (it depends on the kernel and on being root)."""

    isolation: str  # "namespaces", "uid+rlimits" or "rlimits-only"
    filesystem: str  # "private-root" (a read-only root of system dirs + a capped tmpfs) or "host"
    memory: str  # "cgroup" (one budget for all processes) or "rlimits" (address space x processes <= budget)
    reason: str  # why a weaker form is in force ("" when the strongest is)

    def describe(self, limits: SandboxLimits | None = None) -> str:
        limits = limits or SandboxLimits()
        as_bytes, nproc = _memory_limits(limits, self.memory == "cgroup")
        memory = (
            f"memory cgroup of {limits.memory_mb} MB for all its processes (each also RLIMIT_AS {limits.memory_mb} MB)"
            if self.memory == "cgroup"
            else f"rlimits: {nproc} processes x {as_bytes >> 20} MB address space"
        )
        filesystem = (
            f"a private read-only root with a {limits.tmpfs_mb} MB tmpfs as work dir, /tmp and /dev/shm"
            if self.filesystem == "private-root"
            else "the host filesystem (writable: its work dir only)"
        )
        text = f"code sandbox: {self.isolation}; {filesystem}; {memory}"
        return text + (f" ({self.reason})" if self.reason else "")


def sandbox_info() -> SandboxInfo:
    """The containment `run_python` applies here (probed once per process)."""
    use_namespaces = namespaces_available()
    drop_uid = os.geteuid() == 0 and (use_namespaces or _interpreter_reachable_by_others())
    cgroup = memory_cgroup_parent() is not None
    reasons = [] if use_namespaces else ["no namespaces: not root or the kernel refuses them"]
    if not cgroup:
        reasons.append(f"no memory cgroup: {unavailable_reason()}")
    return SandboxInfo(
        isolation="namespaces" if use_namespaces else ("uid+rlimits" if drop_uid else "rlimits-only"),
        filesystem="private-root" if use_namespaces else "host",
        memory="cgroup" if cgroup else "rlimits",
        reason="; ".join(reasons),
    )


def _sweep_stale_dirs() -> None:
    """Remove the host dirs of sandboxes whose scoring process was killed mid-run (a pool worker at its deadline)."""
    for path in Path(tempfile.gettempdir()).glob("rlvr-sandbox-*-*"):
        if owner_gone(path.name.split("-")[2]):
            shutil.rmtree(path, ignore_errors=True)


def _log_once(info: SandboxInfo, limits: SandboxLimits) -> None:
    global _warned, _logged
    if not _logged:
        _logged = True
        log.info("%s", info.describe(limits))
        _sweep_stale_dirs()
    if info.isolation != "namespaces" and not _warned:
        _warned = True
        log.warning(
            "!" * 20 + " %s " + "!" * 20,
            "code sandbox WITHOUT namespaces: no network isolation and no private read-only filesystem "
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
    """
    if not stdins:
        raise ValueError("run_python_many: give at least one stdin")
    limits = limits or SandboxLimits()
    info = sandbox_info()
    _log_once(info, limits)
    use_namespaces = info.isolation == "namespaces"
    uid = _next_uid() if info.isolation != "rlimits-only" else None
    root = Path(tempfile.mkdtemp(prefix=f"rlvr-sandbox-{owner_tag()}-"))
    process = None
    cgroup = None
    try:
        os.chmod(root, 0o711)  # without namespaces the program traverses to its work dir but may not list ours
        io_dir, new_root = root / "io", root / "root"
        io_dir.mkdir(mode=0o700)
        new_root.mkdir()
        (io_dir / "main.py").write_text(source, encoding="utf-8")
        if use_namespaces:
            work_dir, tmp_dir = "/sandbox/work", "/tmp"
        else:  # the host's view: a work dir of our own, the program's only writable place
            work = root / "work"
            work.mkdir(mode=0o700)
            if uid is not None:
                os.chown(work, uid, uid)
            work_dir = tmp_dir = str(work)
        for i, stdin in enumerate(stdins):
            (io_dir / f"stdin-{i}").write_text(stdin, encoding="utf-8")
        if info.memory == "cgroup":
            cgroup = MemoryCgroup.create(limits.memory_mb * 1024 * 1024)
        as_bytes, nproc = _memory_limits(limits, cgroup is not None)
        cfg = {
            "namespaces": use_namespaces,
            "parent_pid": os.getpid(),
            "io_dir": str(io_dir),
            "new_root": str(new_root),
            "work_dir": work_dir,
            "tmp_dir": tmp_dir,
            "runs": len(stdins),
            "wall_s": limits.wall_s,
            "python": _python_executable(),
            "system_dirs": _system_dirs(),
            "tmpfs_mb": limits.tmpfs_mb,
            "tmpfs_inodes": max(1024, limits.tmpfs_mb * 256),
            "cgroup_procs": cgroup.procs_path if cgroup is not None else None,
            "uid": uid,
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
                [_python_executable(), "-I", "-S", str(_LAUNCHER), str(config_path)],
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
            memory=info.memory,
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
                    isolation=info.isolation,
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
                    isolation=info.isolation,
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
