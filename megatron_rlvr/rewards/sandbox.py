"""Run an untrusted Python program in a sandbox and return its exit status and (capped) output.

What contains it (see `sandbox_launcher.py` for the inside half):
- a new session/process group, and, when the kernel allows (root, or CAP_SYS_ADMIN), new mount, network, PID, IPC
  and UTS namespaces: no network at all (a private loopback that is down), every host mount read-only, home
  directories hidden, a private /proc; when the program ends or is killed, its PID namespace dies with everything in
  it;
- a fresh unprivileged uid per run (when we are root): it can neither write root's files nor signal any process
  but its own, and RLIMIT_NPROC counts only its processes — a fork bomb stops at `nproc`;
- rlimits: CPU seconds, address space, file size (also caps stdout/stderr), process count, open files, no core;
- a throw-away working directory (the only writable place), removed afterwards;
- a wall timeout, after which the whole process group is SIGKILLed and, when root, every process of the run's uid.
Without namespaces the run still has rlimits, and the uid drop when we are root and the interpreter is reachable
by other users (not under a 0700 home), but no network isolation and no read-only view: this is logged as a loud
warning once per process, and `SandboxResult.isolation` says which ("uid+rlimits" or "rlimits-only").

No extra package is needed: namespaces come from libc ``unshare`` via ctypes.
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

log = logging.getLogger(__name__)

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_SETUP_FAILED = 125
_UID_BASE = 300_000
_uid_counter = itertools.count()
_uid_lock = threading.Lock()
_probe_result: bool | None = None
_warned = False


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
    output_chars: int = 1 << 20  # stdout/stderr returned to the caller, each


@dataclass
class SandboxResult:
    returncode: int  # 128 + signal when killed by one
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "namespaces", "uid+rlimits" or "rlimits-only" (see the module docstring)


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
                _probe_result = subprocess.run([_python_executable(), "-I", "-S", "-c", probe], timeout=30).returncode == 0
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


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("!" * 20 + " %s " + "!" * 20, message)


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
    use_namespaces = namespaces_available()
    # without namespaces a dropped uid must reach the interpreter on the host's own filesystem view
    drop_uid = os.geteuid() == 0 and (use_namespaces or _interpreter_reachable_by_others())
    if not use_namespaces:
        _warn_once(
            "code sandbox WITHOUT namespaces: no network isolation and no read-only filesystem view "
            + ("(a per-run uid and rlimits only)" if drop_uid else
               "(rlimits only: programs run as THIS user and can touch its files and processes!)")
        )
    isolation = "namespaces" if use_namespaces else ("uid+rlimits" if drop_uid else "rlimits-only")
    uid = _next_uid() if drop_uid else None
    root = Path(tempfile.mkdtemp(prefix="rlvr-sandbox-"))
    process = None
    try:
        os.chmod(root, 0o711)  # the program may traverse to its work dir but not list or read our files
        work, io_dir, staging = root / "work", root / "io", root / "python"
        for d in (work, io_dir, staging):
            d.mkdir()
        os.chmod(io_dir, 0o700)
        (work / "main.py").write_text(source, encoding="utf-8")
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(work / "main.py", uid, uid)
        os.chmod(work, 0o700)
        runs = []
        for i, stdin in enumerate(stdins):
            (io_dir / f"stdin-{i}").write_text(stdin, encoding="utf-8")
            runs.append({name: str(io_dir / f"{name}-{i}") for name in ("stdin", "stdout", "stderr")})
        home = os.path.realpath(os.path.expanduser("~"))
        cfg = {
            "namespaces": use_namespaces,
            "work_dir": str(work),
            "io_dir": str(io_dir),
            "results": str(io_dir / "results.json"),
            "runs": runs,
            "wall_s": limits.wall_s,
            "python": _python_executable(),
            "python_prefix": _python_prefix(),
            "python_staging": str(staging),
            "hide_dirs": sorted({home, "/root", "/home"}),
            "uid": uid,
            "limits": {
                "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                "memory_mb": limits.memory_mb,
                "file_size_mb": limits.file_size_mb,
                "nproc": limits.nproc,
                "nofile": limits.nofile,
            },
        }
        config_path = io_dir / "config.json"
        config_path.write_text(json.dumps(cfg))
        with open(io_dir / "launcher.err", "wb") as launcher_err:
            process = subprocess.Popen(
                [_python_executable(), "-I", "-S", str(_LAUNCHER), str(config_path)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=launcher_err,
                start_new_session=True, close_fds=True, cwd=str(root),
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
        results = []
        for i, status in enumerate(statuses):
            stderr = _read_capped(io_dir / f"stderr-{i}", limits.output_chars)
            if status["returncode"] == _SETUP_FAILED and stderr.startswith("sandbox setup failed"):
                raise SandboxError(stderr.strip())
            results.append(SandboxResult(
                returncode=status["returncode"], stdout=_read_capped(io_dir / f"stdout-{i}", limits.output_chars),
                stderr=stderr, timed_out=status["timed_out"], isolation=isolation,
            ))
        if backstop_hit or not results or (len(results) < len(stdins) and results[-1].returncode == 0 and not results[-1].timed_out):
            # the launcher died or overran before reporting this run: it counts as a timeout
            results.append(SandboxResult(returncode=-signal.SIGKILL, stdout="", stderr=setup_error, timed_out=True,
                                         isolation=isolation))
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
        shutil.rmtree(root, ignore_errors=True)
