"""Inside half of the code sandbox: runs as ``python -I -S sandbox_launcher.py CONFIG`` and execs the program.

Started by `sandbox.run_python` in a new session. As root it enters new mount, network, PID, IPC and UTS
namespaces (libc ``unshare`` through ctypes, no extra package); the first child is the PID namespace's init, so when
it exits the kernel kills every process the program left behind. That init makes the host filesystem read-only,
hides the home directories behind empty tmpfs mounts (re-exposing the Python install read-only, since it may live
there), mounts a private /proc, then runs the program once per input: fork, rlimits, a fresh unprivileged uid of
its own (so RLIMIT_NPROC counts only its processes and it cannot signal anyone else, the supervisor included), exec
of the base interpreter on ``main.py`` in the work directory — the one writable place — a wall timeout per run, and
after each run every process of that uid is killed. Runs stop at the first nonzero exit or timeout; their statuses
go to ``results.json``. One namespace setup thus serves all the test inputs of a stdin/stdout problem. Without namespaces (not root, or the kernel refuses) it still applies the
uid drop when it can and the rlimits always; the caller warns loudly about what is missing.

Only the standard library is used: this file runs under ``-I -S`` before any project import.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        _libc.mount(
            None if source is None else source.encode(), target.encode(),
            None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {source} -> {target}",
    )


def _mount_points():
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(line.split()[4].replace("\\040", " "))
    return points


def _make_filesystem_view(cfg):
    """Read-only host, hidden homes, the work dir writable, the interpreter reachable."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    work, prefix, staging = cfg["work_dir"], cfg["python_prefix"], cfg["python_staging"]
    _mount(prefix, staging, None, MS_BIND | MS_REC)
    _mount(work, work, None, MS_BIND)
    _mount(cfg["io_dir"], cfg["io_dir"], None, MS_BIND)  # root-only (0700): the runs' stdin/stdout files
    for home in cfg["hide_dirs"]:
        if os.path.isdir(home) and not work.startswith(home.rstrip("/") + "/"):
            _mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    if not os.path.isdir(prefix):  # the prefix was under a hidden home: put it back at the same path
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        _mount(staging, prefix, None, MS_BIND | MS_REC)
    for point in _mount_points():
        if point in (work, cfg["io_dir"]) or point.startswith("/proc"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except OSError:
            pass  # special mounts (cgroup, ...) may refuse; the uid drop keeps them unwritable anyway
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
    except OSError:
        pass


def _exec_program(cfg):
    os.chdir(cfg["work_dir"])
    limits = cfg["limits"]
    mb = 1024 * 1024
    for rlimit, value in (
        (resource.RLIMIT_CPU, int(limits["cpu_s"])),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
        (resource.RLIMIT_NPROC, limits["nproc"]),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(rlimit, (value, value))
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = {"PATH": "/usr/bin:/bin", "HOME": cfg["work_dir"], "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
           "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": cfg["work_dir"]}
    python = cfg["python"]
    os.execve(python, [python, "-I", "-S", "main.py"], env)


def _exit_status(status):
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _kill_leftovers(cfg, program):
    """SIGKILL whatever the program left running, then reap it (we are the namespace init or a subreaper)."""
    uid = cfg["uid"]
    if uid is not None:
        helper = os.fork()
        if helper == 0:  # as the program's own uid, kill(-1) reaches exactly its processes (never us: root)
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        os.waitpid(helper, 0)
    else:
        try:
            os.killpg(program, signal.SIGKILL)  # rlimits-only: its own session is all we can name
        except OSError:
            pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def _run_once(cfg, run):
    """One program run with this run's stdin/stdout/stderr files: (exit status, timed out)."""
    fds = [os.open(run["stdin"], os.O_RDONLY)] + [
        os.open(run[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for name in ("stdout", "stderr")
    ]
    program = os.fork()
    if program == 0:
        try:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.setsid()
            _exec_program(cfg)
        except BaseException as exc:  # noqa: BLE001 - report any setup failure and never fall through
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)
    for fd in fds:
        os.close(fd)
    deadline = time.monotonic() + cfg["wall_s"]
    pause, status, timed_out = 0.001, None, False
    while status is None:
        waited, raw = os.waitpid(-1, os.WNOHANG)
        if waited == program:
            status = _exit_status(raw)
        elif waited == 0:
            if not timed_out and time.monotonic() > deadline:
                timed_out = True
                os.kill(program, signal.SIGKILL)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    _kill_leftovers(cfg, program)
    return status, timed_out


def _supervise(cfg):
    """Run the program once per input, stopping at the first failure; results.json is rewritten after each run."""
    results = []
    for run in cfg["runs"]:
        status, timed_out = _run_once(cfg, run)
        results.append({"returncode": status, "timed_out": timed_out})
        tmp = cfg["results"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, cfg["results"])
        if status != 0 or timed_out:
            break


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    if cfg["namespaces"]:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        try:
            _check(_libc.unshare(flags), "unshare")
        except OSError as exc:
            sys.stderr.write(f"sandbox setup failed: {exc}\n")
            return SETUP_FAILED
    init = os.fork()
    if init:
        _, raw = os.waitpid(init, 0)
        return _exit_status(raw)
    # namespace init (or, without namespaces, a subreaper): dies with the launcher, reaps everything
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        if cfg["namespaces"]:
            _make_filesystem_view(cfg)
        _supervise(cfg)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    sys.exit(main())
