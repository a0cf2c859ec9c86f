"""The code sandbox against hostile programs (each contained and scored 0, the host unaffected) and correct ones."""

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_rlvr.rewards import score
from megatron_rlvr.rewards.code import verify_code
from megatron_rlvr.rewards.sandbox import (
    SandboxLimits,
    SandboxUnavailableError,
    run_python,
    sandbox_info,
    use_containment,
)
from tests.unit.rewards.sandbox_helpers import FORK_BOMB, LIMITS, io_reference, leftovers, sandbox_processes

# As root (CI) these run with root's namespaces and per-run uids; as another user, in a user namespace of the
# sandbox's own (test_sandbox_unprivileged.py makes such a user and runs the hostile programs as it).


def test_the_strongest_isolation_is_in_force_here():
    strongest = "namespaces" if os.geteuid() == 0 else "user-namespaces"
    assert sandbox_info().isolation == strongest, sandbox_info()  # this machine allows both kinds
    assert run_python("print(1)", "", LIMITS).isolation == strongest


def test_correct_programs_pass():
    humaneval = {
        "tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    }
    response = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert score("code", response, humaneval) == 1.0
    assert score("code", "```python\ndef add(a, b):\n    return a - b\n```", humaneval) == 0.0
    asserts = {"tests": "assert square(3) == 9\nassert square(-2) == 4\n"}
    assert score("code", "def square(x):\n    return x * x\n", asserts) == 1.0
    livecodebench = {"io": [{"input": "3\n1 2 3\n", "output": "6\n"}, {"input": "2\n10 -4\n", "output": "6"}]}
    program = "```py\nn = int(input())\nprint(sum(map(int, input().split())))\n```"
    assert score("code", program, livecodebench) == 1.0
    assert score("code", "print(6)\nprint('extra')", livecodebench) == 0.0
    assert score("code", "", livecodebench) == 0.0


def test_infinite_loop_is_stopped():
    result = run_python("while True:\n    pass\n", "", LIMITS)
    assert result.returncode != 0
    assert verify_code("while True:\n    pass\nprint('done')", io_reference("done"), LIMITS) == 0.0
    assert verify_code("import time\ntime.sleep(60)\nprint('done')", io_reference("done"), LIMITS) == 0.0
    assert sandbox_processes() == []


def test_fork_bomb_is_contained():
    bomb = FORK_BOMB
    result = run_python(bomb, "", LIMITS)
    assert result.returncode == 0 and int(result.stdout) < LIMITS.nproc, result
    assert verify_code(bomb, io_reference("1000"), LIMITS) == 0.0
    assert sandbox_processes() == []  # the sleeping children died with their PID namespace


def test_memory_bomb_is_contained():
    for bomb in (
        "x = bytearray(8 * 1024**3)\nprint('ok')",
        "chunks = []\nwhile True:\n    chunks.append(' ' * 10**7)\n",
    ):
        assert verify_code(bomb, io_reference("ok"), LIMITS) == 0.0
    result = run_python("x = bytearray(8 * 1024**3)", "", LIMITS)
    assert "MemoryError" in result.stderr


def test_writing_outside_the_work_dir_fails(tmp_path):
    host_only = [
        tmp_path / "pwned",
        Path.home() / f".rlvr_pwned_{uuid.uuid4().hex}",
        Path(__file__).with_name(f"pwned_{uuid.uuid4().hex}"),
    ]
    # with namespaces these two exist inside too, but as the program's own tmpfs: the host's must stay untouched
    private = [Path("/tmp") / f"pwned_{uuid.uuid4().hex}", Path("/dev/shm") / f"pwned_{uuid.uuid4().hex}"]
    program = "import sys\nfor path in sys.stdin.read().split():\n    open(path, 'w').write('x')\nprint('wrote')\n"
    for target in host_only:
        assert verify_code(program, io_reference("wrote", str(target)), LIMITS) == 0.0
        assert not target.exists(), target
    for target in private:
        verify_code(program, io_reference("wrote", str(target)), LIMITS)
        assert not target.exists(), target
    # inside its own work dir it may write
    assert (
        verify_code("open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())", io_reference("x"), LIMITS)
        == 1.0
    )
    assert leftovers() == []


def test_reading_a_file_from_the_home_directory_fails():
    secret = uuid.uuid4().hex
    path = Path.home() / f".rlvr_secret_{secret}"
    path.write_text(secret)
    try:
        program = f"print(open({str(path)!r}).read())"
        result = run_python(program, "", LIMITS)
        assert secret not in result.stdout and result.returncode != 0
        assert verify_code(program, io_reference(secret), LIMITS) == 0.0
    finally:
        path.unlink()


def test_network_socket_cannot_reach_the_host():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'leak')\n"
        "print('connected')\n"
    )
    try:
        result = run_python(program, "", LIMITS)
        assert "connected" not in result.stdout and result.returncode != 0
        assert verify_code(program, io_reference("connected"), LIMITS) == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_killing_its_parent_and_everyone_fails():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    program = (
        "import os, signal\n"
        "for target in (os.getppid(), -1, 1, " + str(os.getpid()) + ", " + str(bystander.pid) + "):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "os.kill(os.getppid(), 0)\n"
        "print('parent survived')\n"
    )
    try:
        result = run_python(program, "", LIMITS)
        assert bystander.poll() is None, "a host process was killed"
        os.kill(os.getpid(), 0)
        assert sandbox_processes() == []
        # as root, its uid may not even probe its parent (EPERM: no output); in a user namespace it shares the
        # parent's uid, and the parent, its PID namespace's init, ignores the SIGKILL
        assert result.stdout.strip() == ("" if result.isolation == "namespaces" else "parent survived"), result
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_output_flood_is_capped():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", "", LIMITS)
    assert result.returncode != 0 and len(result.stdout) <= LIMITS.output_chars


def test_malformed_code_reference_is_a_clear_error():
    for bad in ({"io": []}, {"io": [{"input": 1, "output": "x"}]}, {"tests": 3}, {"entry_point": "f"}, "assert 1"):
        with pytest.raises(ValueError, match="code reference"):
            verify_code("print(1)", bad, LIMITS)


def test_without_namespaces_programs_are_refused_unless_rlimits_only_is_accepted(tmp_path, caplog):
    import megatron_rlvr.rewards.sandbox as sandbox

    accepted = SandboxLimits(**{**LIMITS.__dict__, "accept_rlimits_only": True})
    sandbox.reset_warnings()
    with use_containment("none"):  # as on a kernel that refuses every namespace
        with pytest.raises(SandboxUnavailableError, match=r"no isolation.*reward\.sandbox_accept_rlimits_only=true"):
            run_python("print(1)", "", LIMITS)
        with pytest.raises(SandboxUnavailableError):  # the code reward too: not a score of 0, a stop
            verify_code("print(input()[::-1])", io_reference("cba", "abc"), LIMITS)
        with caplog.at_level("WARNING", logger="megatron_rlvr.rewards.sandbox"):
            result = run_python("import os\nprint(os.getuid())", "", accepted)
        assert any("WITHOUT namespaces" in r.message for r in caplog.records)
        assert verify_code("print(input()[::-1])", io_reference("cba", "abc"), accepted) == 1.0
        if result.isolation == "uid+rlimits":  # root, with an interpreter other users may run
            assert int(result.stdout) != 0
            target = tmp_path / "pwned"
            program = f"open({str(target)!r}, 'w').write('x')\nprint('wrote')"
            assert verify_code(program, io_reference("wrote"), accepted) == 0.0
            assert not target.exists()
        else:  # not root, or Python under a 0700 /root: no other uid could exec it, so the program keeps ours
            assert result.isolation == "rlimits-only" and int(result.stdout) == os.getuid()
            assert any("THIS user" in r.message for r in caplog.records)


def test_many_inputs_share_one_sandbox_with_limits_per_run():
    from megatron_rlvr.rewards.sandbox import run_python_many

    program = (
        "import os, time\n"
        "line = input()\n"
        "if line == 'loop':\n"
        "    while True: pass\n"
        "if line == 'orphan' and os.fork() == 0:\n"
        "    time.sleep(60)\n"
        "print(line.upper())\n"
    )
    results = run_python_many(program, ["a", "orphan", "b", "loop", "never"], LIMITS)
    assert [r.stdout.strip() for r in results[:3]] == ["A", "ORPHAN", "B"]
    assert all(r.returncode == 0 and not r.timed_out for r in results[:3])
    assert len(results) == 4 and results[3].returncode != 0  # the loop was stopped; "never" was not run
    assert sandbox_processes() == []  # the orphan of run 2 did not outlive its run
