"""Shared pieces of the sandbox tests: small limits, and finding what a sandbox might have left on the host."""

import os
from pathlib import Path

from megatron_rlvr.rewards import cgroup
from megatron_rlvr.rewards.sandbox import SandboxLimits
from megatron_rlvr.rewards.sandbox_run import run_uids

LIMITS = SandboxLimits(cpu_s=2, wall_s=5, memory_mb=512, nproc=16)


def _nested_pid_namespace(status: str) -> bool:
    """Whether a /proc/PID/status is of a process in a PID namespace below ours (NSpid lists one pid per level)."""
    ours = _own_levels()
    return any(line.startswith("NSpid:") and len(line.split()) - 1 > ours for line in status.splitlines())


def _own_levels() -> int:
    with open("/proc/self/status") as f:
        return next(len(line.split()) - 1 for line in f if line.startswith("NSpid:"))


def sandbox_processes(*owners: int) -> list[int]:
    """Host processes of the sandboxes this process started, or the processes ``owners`` (there must be none after a
    run): one of their per-run uids, or a cwd in one of their sandbox dirs, or (not root: every sandbox runs as us, in
    a user namespace) one of ours in a PID namespace below ours. As root, the sandboxes of other processes (tests
    running beside these, in another xdist worker or another session) do not count."""
    owners = owners or (os.getpid(),)
    uids = {uid for pid in owners for uid in run_uids(pid)}
    dirs = tuple(f"rlvr-sandbox-{pid}." for pid in owners)  # sandbox_run: named by cgroup.owner_tag(), pid first
    found = []
    uid_here = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
            uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            nested_ours = uid_here != 0 and uid == uid_here and _nested_pid_namespace(status)
            if uid in uids or nested_ours or any(d in os.readlink(f"/proc/{entry}/cwd") for d in dirs):
                found.append(int(entry))
        except (OSError, StopIteration, ValueError):
            pass
    return found


def sandbox_programs(source: str, *owners: int) -> list[int]:
    """The programs of ``source`` among ``sandbox_processes(*owners)``: run in a work dir whose ``main.py`` holds it.
    Nothing less is steady while a sandbox starts: its launcher is found only while its cwd is the sandbox's host
    dir, which it leaves for the new root before the program starts, and the first run of a process is the
    containment probe's own short program."""
    found = []
    for pid in sandbox_processes(*owners):
        try:
            if Path(f"/proc/{pid}/cwd/main.py").read_text() == source:
                found.append(pid)
        except (OSError, UnicodeDecodeError):
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


def disk_fill_on_the_host() -> list[str]:
    """DISK_FILL's files in the host's /tmp and /dev/shm: none when its writes stayed in the sandbox's own tmpfs."""
    return [str(p) for d in ("/tmp", "/dev/shm") for p in Path(d).glob(f"{DISK_FILL_PREFIX}*")]


def io_reference(expected: str, stdin: str = "") -> dict:
    return {"io": [{"input": stdin, "output": expected}]}


# Hostile programs, shared by the sandbox's tests and the Python tool's (tests/unit/environments): what each must show

# prints each file named on stdin: contained, it prints nothing and ends in FileNotFoundError
READ_FILES = "import sys\nfor path in sys.stdin.read().split():\n    print(open(path).read())\n"

# forks sleeping children until refused; prints how many it made (contained: fewer than the nproc limit)
FORK_BOMB = (
    "import os\n"
    "children = 0\n"
    "for _ in range(100000):\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            import time; time.sleep(30); os._exit(0)\n"
    "        children += 1\n"
    "    except OSError:\n"
    "        break\n"
    "print(children)\n"
)

# 1 MB files into the work dir, /tmp and /dev/shm until refused; prints "refused: ..." then the files written and the
# size of its filesystem in MB (contained: "No space left", at most the tmpfs cap)
DISK_FILL_PREFIX = "rlvr-disk-fill-"  # the names of its files, which the host's /tmp and /dev/shm must never hold
DISK_FILL = (
    "import os\n"
    "written = 0\n"
    "try:\n"
    "    for i in range(300):\n"
    f"        with open(f\"{{('.', '/tmp', '/dev/shm')[i % 3]}}/{DISK_FILL_PREFIX}{{i}}\", 'wb') as f:\n"
    "            f.write(b'x' * (1 << 20))\n"
    "        written += 1\n"
    "except OSError as exc:\n"
    "    print('refused:', exc)\n"
    "st = os.statvfs('.')\n"
    "print(written, st.f_blocks * st.f_frsize >> 20)\n"
)


def memory_by_many_processes(children: int, mb_each: int) -> str:
    """Forks ``children`` that each touch ``mb_each`` MB and hold it; prints how many finished holding it."""
    return (
        "import os, time\n"
        "kids = []\n"
        f"for _ in range({children}):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        try:\n"
        f"            block = b'x' * ({mb_each} << 20)\n"
        "            time.sleep(1.0)\n"
        "            os._exit(0)\n"
        "        except MemoryError:\n"
        "            os._exit(3)\n"
        "    kids.append(pid)\n"
        "print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids))\n"
    )


# connects to the port on stdin at 127.0.0.1 and sends to it (contained: no route, no "connected")
CONNECT = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.stdin.read())), timeout=2)\n"
    "s.sendall(b'leak')\n"
    "print('connected')\n"
)

# writes each file named on stdin (contained: none of them appears on the host)
WRITE_FILES = "import sys\nfor path in sys.stdin.read().split():\n    open(path, 'w').write('x')\nprint('wrote')\n"


def with_stdin(program: str, stdin: str) -> str:
    """``program`` reading ``stdin`` from a string (for callers that run code without a stdin, like the tool)."""
    return f"import io, sys\nsys.stdin = io.StringIO({stdin!r})\n" + program
