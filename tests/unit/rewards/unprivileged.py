"""Run a test module as an unprivileged user the test creates, as a Slurm job runs: not root, no capabilities.

`unprivileged_user()` makes a user (``useradd -M``) and removes it afterwards. `run_as(user, module, payload)` runs
``python -m module`` as that user, with ``payload`` (JSON) on stdin, and returns its stdout parsed as JSON. On the
way, a small root stage (this file's ``main``, in a child process) prepares a private mount namespace in which the
user can reach what it needs: where the interpreter, the venv or the checkout lie under a directory others may not
enter (a 0700 /root), that directory is covered by a tmpfs that shows just those paths. Nothing changes on the host.
With ``user_namespaces=False`` the stage first enters a user namespace of its own (all ids mapped as they are) and
sets its ``/proc/sys/user/max_user_namespaces`` to 0: the user then finds user namespaces turned off, as on a kernel
or cluster that disables them, while the rest of the machine is untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_CLONE_NEWNS, _CLONE_NEWUSER = 0x20000, 0x10000000
_MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 4096, 8192, 16384, 1 << 18


@contextlib.contextmanager
def unprivileged_user() -> Iterator[pwd.struct_passwd]:
    name = f"rlvrsbx{os.getpid()}"
    subprocess.run(["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def run_as(
    user: pwd.struct_passwd, module: str, payload: dict, *, user_namespaces: bool = True, timeout_s: float = 240
) -> dict:
    """``python -m module`` as ``user`` with ``payload`` on stdin; its stdout's last line, parsed as JSON."""
    stage = {"uid": user.pw_uid, "gid": user.pw_gid, "user_namespaces": user_namespaces, "module": module}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.rewards.unprivileged", json.dumps(stage)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    assert done.returncode == 0, f"{module} as {user.pw_name} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731 - a one-line adapter for ctypes
    _libc_call("mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def _closed_ancestor(path: Path) -> Path | None:
    """The topmost directory above (or at) ``path`` that others may not enter, if any."""
    for directory in [*reversed(path.parents), path]:
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return directory
    return None


def _reveal(paths: list[Path]) -> None:
    """Make ``paths`` reachable by any user in this mount namespace: each closed directory above them becomes a
    tmpfs that holds only them (bind mounts of the originals)."""
    covers: dict[Path, list[Path]] = {}
    for path in sorted({p.resolve() for p in paths}):
        closed = _closed_ancestor(path)
        if closed is not None and not any(path.is_relative_to(p) for p in covers.get(closed, [])):
            covers.setdefault(closed, []).append(path)
    stash = Path(tempfile.mkdtemp(prefix="rlvr-reveal-"))
    for closed, inside in covers.items():
        held = []
        for i, path in enumerate(inside):
            (stash / str(i)).mkdir()
            _mount(str(path), str(stash / str(i)), None, _MS_BIND | _MS_REC)
            held.append((stash / str(i), path))
        _mount("tmpfs", str(closed), "tmpfs", 0, "mode=755,size=1m")
        for source, path in held:
            path.mkdir(parents=True, mode=0o755)
            _mount(str(source), str(path), None, _MS_MOVE)
            source.rmdir()  # empty again once its mount moved
    stash.rmdir()


def _without_user_namespaces() -> None:
    """Enter a user namespace mapping every id to itself (a parent writes the maps), and turn user namespaces off
    in it: its processes, and those of the user we become, may make none."""
    ready_r, ready_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:  # the mapper: waits for the unshare, writes the maps, exits
        os.read(ready_r, 1)
        pid = os.getppid()
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{pid}/{name}").write_text("0 0 4294967295\n")
        os.write(mapped_w, b"x")
        os._exit(0)
    _libc_call("unshare", _CLONE_NEWUSER)
    os.write(ready_w, b"x")
    os.read(mapped_r, 1)
    os.waitpid(child, 0)
    Path("/proc/sys/user/max_user_namespaces").write_text("0\n")


def main() -> None:
    stage = json.loads(sys.argv[1])
    _libc_call("unshare", _CLONE_NEWNS)
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below reaches the host's mounts
    _reveal([Path(sys.base_prefix), Path(sys.prefix), Path(os.path.realpath(sys.executable)).parent, REPO])
    if not stage["user_namespaces"]:
        _without_user_namespaces()
    home = tempfile.mkdtemp(prefix="home-of-test-user-")  # useradd -M made none; the fixture removes it
    os.chown(home, stage["uid"], stage["gid"])
    os.setgroups([])
    os.setgid(stage["gid"])
    os.setuid(stage["uid"])
    os.chdir(REPO)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "TMPDIR": "/tmp",
    }
    os.execve(sys.executable, [sys.executable, "-m", stage["module"]], env)


if __name__ == "__main__":
    main()
