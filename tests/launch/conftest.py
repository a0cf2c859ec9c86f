"""The `slurm_cluster` fixture: a real two-node Slurm cluster on this machine (tools/env/slurm_cluster.sh), started once
per test session for the tests marked `slurm`, in a state directory of the session's own, and stopped at its end.

It skips (with the reason) only where the cluster cannot be made: not root, or packages missing and no apt-get.
Where it can be made and fails to start, the tests fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tools" / "env" / "slurm_cluster.sh"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")
START_TIMEOUT_S = 600  # a fresh machine: apt-get update + install (~1 min here) + MariaDB's first start


def _installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return out.returncode == 0 and "ok installed" in out.stdout


def cannot_make_a_cluster() -> str | None:
    """Why this machine cannot run the local cluster, or None when it can."""
    if shutil.which("dpkg-query") is None:
        return "no dpkg: tools/env/slurm_cluster.sh installs Debian packages"
    missing = [p for p in PACKAGES if not _installed(p)]
    if os.geteuid() != 0:
        return "not root: slurmd and the cluster's packages need root (tools/env/slurm_cluster.sh)"
    if missing and shutil.which("apt-get") is None:
        return f"no apt-get to install {', '.join(missing)}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of the running cluster (also exported to os.environ for the session)."""
    reason = cannot_make_a_cluster()
    if reason:
        pytest.skip(reason)
    # a directory of our own, not under pytest's basetemp: pytest deletes all but the newest 3 of those when any
    # other session starts, and the cluster's state (pid files, config) went with it once; short, too, for the munge
    # socket's path (108 bytes at most)
    state = Path(tempfile.mkdtemp(prefix="mrlvr-slurm-", dir="/tmp"))
    env = {**os.environ, "MEGATRON_RLVR_SLURM_DIR": str(state)}
    start = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    conf = state / "etc" / "slurm.conf"
    try:
        assert start.returncode == 0, f"tools/env/slurm_cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        print(start.stdout)
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(conf)
        yield conf
    finally:
        stop = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120
        )
        print(stop.stdout, stop.stderr)
        if stop.returncode == 0:
            shutil.rmtree(state, ignore_errors=True)
        if "old" in locals():
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
