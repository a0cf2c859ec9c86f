"""The sandbox's filesystem, disk and memory budgets against hostile programs: each scores 0 and the host is untouched.

- reading the host's files (its /tmp, /dev/shm, home, the repository: where a policy would find test cases);
- filling the disk with many files, each under the file-size limit;
- taking memory with many processes, each under the per-process limit.
(The pool's check that its workers' budgets fit in memory is in test_pool.py.)
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_rlvr.rewards import cgroup, sandbox_run
from megatron_rlvr.rewards.code import verify_code
from megatron_rlvr.rewards.sandbox import SandboxLimits, run_python, sandbox_info, use_containment
from tests.unit.rewards.sandbox_helpers import (
    DISK_FILL,
    READ_FILES,
    disk_fill_on_the_host,
    io_reference,
    leftovers,
    memory_by_many_processes,
    sandbox_processes,
    sandbox_programs,
)

# small budgets keep the hostile programs fast; generous time limits keep a loaded machine from failing a run early
SMALL = SandboxLimits(cpu_s=10, wall_s=30, memory_mb=256, nproc=16, tmpfs_mb=64)
needs_isolation = pytest.mark.skipif(not sandbox_info().isolated, reason="the kernel refuses every namespace")
needs_memcg = pytest.mark.skipif(
    cgroup.memory_cgroup_parent() is None, reason=f"no memory cgroup here: {cgroup.unavailable_reason()}"
)


def test_the_strongest_containment_is_in_force_here():
    info = sandbox_info()
    assert info.isolated and info.filesystem == "private-root", info  # this machine allows namespaces
    if os.geteuid() == 0 and cgroup._memory_mount() is not None:
        assert info.memory == "cgroup", info  # root with the controller mounted: no reason to fall back
    assert "code sandbox:" in info.describe(SMALL)


@needs_isolation
def test_host_files_cannot_be_read(tmp_path):
    secret = uuid.uuid4().hex
    files = [
        Path("/tmp") / f"rlvr_tests_{secret}.json",
        Path("/dev/shm") / f"rlvr_{secret}",
        tmp_path / "answers",
        Path.home() / f".rlvr_{secret}",
        Path(__file__).with_name(f"answers_{secret}.txt"),
    ]
    program = READ_FILES
    try:
        for path in files:
            path.write_text(secret)
            os.chmod(path, 0o644)  # readable by any uid: only the filesystem view can keep it out
            assert verify_code(program, io_reference(secret, str(path)), SMALL) == 0.0, path
            result = run_python(program, str(path), SMALL)
            assert not result.timed_out, result
            assert secret not in result.stdout and "FileNotFoundError" in result.stderr, (path, result)
    finally:
        for path in files:
            path.unlink(missing_ok=True)
    # what it sees instead: the system dirs and the interpreter, read-only, its tmpfs, and a minimal /dev and /etc
    result = run_python(
        "import json, os\nprint(json.dumps([sorted(os.listdir(d)) for d in ('/', '/dev', '/etc')]))\n"
        "for path in ('/usr/pwned', '/etc/pwned', '/pwned', '/dev/pwned', os.__file__ + '.pwned'):\n"
        "    try:\n        open(path, 'w')\n        print('wrote', path)\n    except OSError:\n        pass\n",
        "",
        SMALL,
    )
    top, dev, etc = json.loads(result.stdout.splitlines()[0])
    assert set(top) <= {
        "bin",
        "sbin",
        "usr",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "etc",
        "dev",
        "proc",
        "tmp",
        "sandbox",
        *[Path(d).parts[1] for d in sandbox_run.system_dirs()],
    }, top
    assert "work" not in top and "home" not in top and "data" not in top
    assert set(dev) <= {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}, dev
    assert set(etc) <= {"passwd", "group", "hosts", "ld.so.cache"}, etc
    assert "wrote" not in result.stdout, result.stdout


@needs_isolation
def test_disk_fill_by_many_files_stops_at_the_tmpfs_cap():
    # 1 MB files (far under the 16 MB file-size limit) into the work dir, /tmp and /dev/shm, until refused
    program = DISK_FILL
    assert verify_code(program, io_reference("300 64"), SMALL) == 0.0
    result = run_python(program, "", SMALL)
    written, fs_mb = map(int, result.stdout.split()[-2:])
    assert "No space left" in result.stdout and fs_mb == SMALL.tmpfs_mb, result
    assert written <= SMALL.tmpfs_mb, result  # /tmp and /dev/shm share the one capped tmpfs
    # its ~3 x 64 MB never reached the host: the work dir is the tmpfs (statvfs above), and the host's /tmp and
    # /dev/shm hold none of its files (a count of the host disk's free space also saw every other process's writes)
    assert disk_fill_on_the_host() == []
    assert leftovers() == [] and sandbox_processes() == []


@needs_isolation
def test_many_empty_files_stop_at_the_inode_cap():
    program = (
        "n = 0\ntry:\n    for i in range(10**6):\n        open(f'e{i}', 'w').close()\n        n += 1\n"
        "except OSError:\n    pass\nprint(n)\n"
    )
    result = run_python(program, "", SandboxLimits(cpu_s=5, wall_s=10, memory_mb=256, tmpfs_mb=4))
    assert result.returncode == 0 and 0 < int(result.stdout) < 1024, result  # nr_inodes: 1024 at least, 256 per MB


@needs_memcg
def test_memory_by_many_processes_is_one_budget():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # 6 x 64 MB = 384 MB against a 256 MB budget; each child alone is far under its 256 MB address space
        program = memory_by_many_processes(6, 64)
        assert verify_code(program, io_reference("6"), SMALL) == 0.0
        result = run_python(program, "", SMALL)
        assert result.memory == "cgroup" and result.oom_kills >= 1, result
        assert result.memory_peak_mb <= SMALL.memory_mb and int(result.stdout) < 6, result
        assert bystander.poll() is None  # the kernel's OOM killer chose inside the sandbox's group
        assert leftovers() == [] and sandbox_processes() == []
        # within its budget the same program passes: the budget is for all of them, not one
        assert verify_code(memory_by_many_processes(3, 40), io_reference("3"), SMALL) == 1.0
    finally:
        bystander.kill()
        bystander.wait()


@needs_isolation
def test_without_a_memory_cgroup_rlimits_keep_processes_times_address_space_within_the_budget():
    as_bytes, nproc = sandbox_run.memory_limits(SMALL, cgroup=False)
    assert as_bytes * nproc <= SMALL.memory_mb << 20 and as_bytes >= sandbox_run.MIN_PROCESS_MB << 20
    program = memory_by_many_processes(6, 64)
    with use_containment(memory="rlimits"):
        assert sandbox_info().memory == "rlimits"
        result = run_python(program, "", SMALL)
        assert result.memory == "rlimits" and int(result.stdout) * 64 < SMALL.memory_mb, result
        assert verify_code(program, io_reference("6"), SMALL) == 0.0
        assert verify_code("block = b'x' * (50 << 20)\nprint('ok')", io_reference("ok"), SMALL) == 1.0
    assert leftovers() == [] and sandbox_processes() == []


@needs_memcg
def test_a_timed_out_program_leaves_no_cgroup_and_a_dead_owners_groups_are_swept():
    result = run_python("import time\ntime.sleep(60)", "", SandboxLimits(wall_s=1, cpu_s=1, memory_mb=64))
    assert result.timed_out and leftovers() == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = cgroup.memory_cgroup_parent()
    stale, live = parent / f"{dead.pid}.12345-0", parent / f"{cgroup.owner_tag()}-999"
    stale.mkdir()
    live.mkdir()
    try:
        cgroup._sweep_stale(parent)
        assert not stale.exists() and live.exists()  # a live owner's groups stay, even while it holds none open
    finally:
        for group in (stale, live):
            cgroup.MemoryCgroup(group).remove()


@needs_isolation
def test_a_killed_scoring_process_takes_its_sandbox_along():
    """A pool worker SIGKILLed at its deadline must not leave the program running, nor its cgroup and files."""
    program = "import time\ntime.sleep(120)"
    scorer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from megatron_rlvr.rewards.sandbox import SandboxLimits, run_python\n"
            f"run_python({program!r}, '', SandboxLimits(wall_s=120, cpu_s=120, memory_mb=128))\n",
        ],
        cwd=Path(__file__).parents[3],
    )
    try:
        deadline = time.monotonic() + 30
        while not sandbox_programs(program, scorer.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sandbox_programs(program, scorer.pid), "the program never started"
    finally:
        scorer.send_signal(signal.SIGKILL)
        scorer.wait()
    deadline = time.monotonic() + 5
    while sandbox_processes(scorer.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(scorer.pid) == []
    # its host dir and its group outlive it until the next scoring process (the replacement worker) sweeps them
    sweeper = subprocess.run(
        [
            sys.executable,
            "-c",
            "from megatron_rlvr.rewards.sandbox import run_python\nassert run_python('print(1)').stdout == '1\\n'\n",
        ],
        cwd=Path(__file__).parents[3],
        timeout=60,
    )
    assert sweeper.returncode == 0 and leftovers(scorer.pid) == []
