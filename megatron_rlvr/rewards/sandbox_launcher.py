"""Inside half of the code sandbox: runs as ``python -I -S sandbox_launcher.py CONFIG`` and execs the program.

Started by `sandbox.run_python` in a new session; it dies with the process that started it (PR_SET_PDEATHSIG). Its
``isolation`` is one of:
- ``namespaces`` (root): new mount, network, PID, IPC and UTS namespaces (libc ``unshare`` through ctypes, no extra
  package), and each run as a fresh unprivileged uid of its own (so RLIMIT_NPROC counts only its processes and it
  cannot signal anyone else, the supervisor included);
- ``user-namespaces`` (not root): a new user namespace first, in which this process is the owner, mapped to one uid
  inside (``/proc/self/uid_map``, after "deny" in ``/proc/self/setgroups``), then the same five namespaces, owned by
  it. The program runs as that uid with no capabilities (execve drops them: it is not uid 0 inside), RLIMIT_NPROC
  counts only the processes of this user namespace, and no further user namespace can be made inside it;
- ``none``: a work dir on the host, with the cgroup and the uid drop when they can be had and the rlimits always;
  the caller refuses this unless the user accepted it (``reward.sandbox_accept_rlimits_only``).
With namespaces the first child is the PID namespace's init, so when it exits the kernel kills every process the
program left behind. That init opens what it still needs of the host (the io directory with the runs' stdin/stdout
files, the memory cgroup's ``cgroup.procs``) and builds the program's root in a tmpfs, all inside its private mount
namespace (nothing propagates to the host): read-only bind mounts of the system dirs and the interpreter's prefix, a
minimal /etc and /dev, a private /proc, and one size- and inode-capped tmpfs holding the work dir, /tmp and
/dev/shm; then pivot_root into it and detach the host's tree, and joins the memory cgroup. It then runs the program
once per input: fork, the OOM killer's first choice (oom_score_adj 1000), rlimits, the program's uid, no new
privileges, exec of the base interpreter on ``main.py`` in the work directory, a wall timeout per run, and after each
run every other process of the namespace is killed. Runs stop at the first nonzero exit or timeout; their statuses
go to ``results.json``. One setup thus serves all the test inputs of a stdin/stdout problem.

Only the standard library is used: this file runs under ``-I -S`` before any project import.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    8192,
    16384,
    1 << 18,
)
MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}  # no glibc wrapper
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
# what statvfs reports of a mount -> the mount flag that keeps it: a remount inside a user namespace may not drop a
# flag the mount had (the kernel locks them), so a read-only remount carries the ones it found
_KEPT_FLAGS = (
    (1, MS_RDONLY),
    (2, MS_NOSUID),
    (4, MS_NODEV),
    (8, MS_NOEXEC),
    (1024, 1024),
    (2048, 2048),
    (4096, 1 << 21),
)
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
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


def _bind_file(source, target):
    with open(target, "w"):
        pass
    _mount(source, target, None, MS_BIND)


def _build_root(cfg, source):
    """A new root in a tmpfs: read-only system dirs and interpreter, a minimal /etc and /dev, a private /proc, and
    the program's one writable place, a size-capped tmpfs holding its work dir, /tmp and /dev/shm."""
    root, owner = cfg["new_root"], cfg["owner"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for path in cfg["system_dirs"]:  # /usr, /lib64, ..., the interpreter's prefix
        inside = root + path
        if os.path.islink(path) and os.path.dirname(path) == "/":  # merged /usr: /bin -> usr/bin stays a link
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, mode=0o755, exist_ok=True)
            _mount(path, inside, None, MS_BIND | MS_REC)
    os.makedirs(root + "/etc", mode=0o755, exist_ok=True)
    if os.path.exists("/etc/ld.so.cache"):  # the dynamic loader's index of the library dirs
        _bind_file("/etc/ld.so.cache", root + "/etc/ld.so.cache")
    for name, text in (
        ("passwd", f"root:x:0:0:root:/:/bin/false\nsandbox:x:{owner}:{owner}:sandbox:/sandbox/work:/bin/false\n"),
        ("group", f"root:x:0:\nsandbox:x:{owner}:\n"),
        ("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
    ):
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    os.mkdir(root + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        _bind_file("/dev/" + name, f"{root}/dev/{name}")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/proc", 0o555)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
    scratch = root + "/sandbox"
    os.mkdir(scratch, 0o755)
    _mount(
        "tmpfs",
        scratch,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={cfg['tmpfs_mb']}m,nr_inodes={cfg['tmpfs_inodes']},mode=755",
    )
    for name, mode, where in (("tmp", 0o1777, "/tmp"), ("shm", 0o1777, "/dev/shm"), ("work", 0o700, None)):
        os.mkdir(f"{scratch}/{name}")
        os.chmod(f"{scratch}/{name}", mode)  # mkdir's mode passes through the umask; chmod does not
        if where is not None:
            os.mkdir(root + where, 0o755)
            _mount(f"{scratch}/{name}", root + where, None, MS_BIND)
    os.chown(scratch + "/work", owner, owner)
    with open(scratch + "/work/main.py", "wb") as f:
        f.write(source)
    os.chown(scratch + "/work/main.py", owner, owner)
    writable = {scratch, root + "/tmp", root + "/dev/shm", root + "/proc"}
    writable.update(f"{root}/dev/{name}" for name in ("null", "zero", "full", "random", "urandom"))
    for point in _mount_points():  # everything else under the new root, the recursive binds' submounts too
        if (point == root or point.startswith(root + "/")) and point not in writable:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _kept_flags(point))


def _kept_flags(path):
    """The mount flags ``path``'s mount has now (a user namespace may not remount without them)."""
    have = os.statvfs(path).f_flag
    flags = 0
    for reported, flag in _KEPT_FLAGS:
        if have & reported:
            flags |= flag
    return flags


def _write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def _enter_user_namespace(cfg):
    """Become the owner of a new user namespace holding the five others, mapped to ``cfg["owner"]`` inside."""
    uid, gid = os.geteuid(), os.getegid()  # who we are on the host: the one id the new namespace maps
    _check(_libc.unshare(CLONE_NEWUSER | NAMESPACES), "unshare(CLONE_NEWUSER and the others)")
    _write_file("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write_file("/proc/self/uid_map", f"{cfg['owner']} {uid} 1\n")
    _write_file("/proc/self/gid_map", f"{cfg['owner']} {gid} 1\n")


def _enter_root(root):
    """Make ``root`` the root of this mount namespace and drop the host's tree from it (pivot_root)."""
    os.chdir(root)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is not None and _libc.syscall(ctypes.c_long(number), b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")  # the host tree was stacked on top of us
    else:  # unknown arch or a root that is no mount point: move over / and chroot (root-only to undo)
        _mount(".", "/", None, MS_MOVE)
        _check(_libc.chroot(b"."), "chroot")
    os.chdir("/")


def _exec_program(cfg):
    os.chdir(cfg["work_dir"])
    limits = cfg["limits"]
    mb = 1024 * 1024
    for rlimit, value in (
        (resource.RLIMIT_CPU, int(limits["cpu_s"])),
        (resource.RLIMIT_AS, limits["as_bytes"]),
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
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")  # no setuid binary raises it again
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": cfg["work_dir"],
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": cfg["tmp_dir"],
    }
    python = cfg["python"]
    os.execve(python, [python, "-I", "-S", "main.py"], env)


def _exit_status(status):
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _kill_leftovers(cfg, program):
    """SIGKILL whatever the program left running, then reap it (we are the namespace init or a subreaper)."""
    uid = cfg["uid"]
    if cfg["isolation"] != "none" and os.getpid() == 1:
        # the PID namespace's init: kill(-1) reaches every other process of the namespace, and only those
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing left to kill
            pass
        while True:  # all of them are dying: wait for each, so the next run starts with none counted against it
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
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


def _set_oom_score_adj(value):
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(value))


def _run_once(cfg, index, io_fd):
    """Run ``index`` with its stdin/stdout/stderr files (in the io directory): (exit status, timed out)."""
    fds = [os.open(f"stdin-{index}", os.O_RDONLY, dir_fd=io_fd)] + [
        os.open(f"{name}-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=io_fd)
        for name in ("stdout", "stderr")
    ]
    program = os.fork()
    if program == 0:
        try:
            # the OOM killer's first choice, in the memory cgroup (before the init, which shares it) and on the host
            _set_oom_score_adj(1000)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.setsid()
            _exec_program(cfg)  # every other descriptor of ours is close-on-exec (Python's default)
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


def _supervise(cfg, io_fd):
    """Run the program once per input, stopping at the first failure; results.json is rewritten after each run."""
    results = []
    for index in range(cfg["runs"]):
        status, timed_out = _run_once(cfg, index, io_fd)
        results.append({"returncode": status, "timed_out": timed_out})
        fd = os.open("results.json.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=io_fd)
        with open(fd, "w") as f:
            json.dump(results, f)
        os.replace("results.json.tmp", "results.json", src_dir_fd=io_fd, dst_dir_fd=io_fd)
        if status != 0 or timed_out:
            break


def _init(cfg):
    """The namespace's init (or, without namespaces, a subreaper): set up the program's world, then run it."""
    # descriptors opened before the host tree goes away: the io directory and the memory cgroup to join
    io_fd = os.open(cfg["io_dir"], os.O_RDONLY | os.O_DIRECTORY)
    cgroup_fd = os.open(cfg["cgroup_procs"], os.O_WRONLY) if cfg["cgroup_procs"] else None
    with open(os.open("main.py", os.O_RDONLY, dir_fd=io_fd), "rb") as f:
        source = f.read()
    if cfg["isolation"] != "none":
        # a program may signal its init only where they share a uid (user namespaces): the kernel drops the signals an
        # init leaves at their default, and Python's own SIGINT handler would be one it obeys
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount from here on reaches the host
        _build_root(cfg, source)
        _enter_root(cfg["new_root"])
        if cfg["isolation"] == "user-namespaces":  # this namespace's own limit: no nested user namespace for it
            _write_file("/proc/sys/user/max_user_namespaces", "0")
    else:
        path = os.path.join(cfg["work_dir"], "main.py")
        with open(path, "wb") as f:
            f.write(source)
        if cfg["uid"] is not None:
            os.chown(path, cfg["uid"], cfg["uid"])
    if cgroup_fd is not None:
        # join the memory cgroup once, so the programs are born in it: each join waits for an RCU grace period
        # (~10 ms), too much per run of a 20-case problem; the init's own few MB count (its programs go first)
        os.write(cgroup_fd, b"0")
        os.close(cgroup_fd)
    _supervise(cfg, io_fd)


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    # die with the scoring process that started us (a pool worker killed at its deadline takes its sandbox along)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        return SETUP_FAILED
    try:
        if cfg["isolation"] == "namespaces":
            _check(_libc.unshare(NAMESPACES), "unshare")
        elif cfg["isolation"] == "user-namespaces":
            _enter_user_namespace(cfg)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a change of credentials may have cleared it
            if os.getppid() != cfg["parent_pid"]:
                return SETUP_FAILED
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
        _init(cfg)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001
        os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    sys.exit(main())
