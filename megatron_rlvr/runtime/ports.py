"""TCP ports for rendezvous on this machine: one taken now and used at once, and one that must stay free for minutes.

A port found by binding port 0 comes from the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), the same
range every other port-0 bind and every outgoing connection draws from. That is fine for a port used within seconds.
A Slurm job's rendezvous port is fixed at submission and reused by its requeued rerun minutes later; in between,
any process on the head node (a vLLM engine's store, a gloo pair, a client socket) may be handed the same ephemeral
port, and the rerun's agents then cannot host their store and time out. A port outside the ephemeral range is
never handed out that way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, where the file cannot be read
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
# ports below this are the well-known and the commonly registered ones (29500 is torchrun's default)
LOWEST_LASTING_PORT = 30000


def free_port() -> int:
    """A TCP port free on the loopback interface right now, from the ephemeral range: for a rendezvous used at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), or Linux's default where `path` cannot be read."""
    try:
        first, last = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


def lasting_free_port(path: Path = EPHEMERAL_RANGE_FILE, tries: int = 64) -> int:
    """A TCP port free now and outside the ephemeral range (see the module's docstring), for a rendezvous that a
    requeued job reuses. Falls back to `free_port()` where the range leaves no room or every try is taken."""
    first, last = ephemeral_range(path)
    candidates = [*range(LOWEST_LASTING_PORT, first), *range(last + 1, 65536)]
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    return free_port()
