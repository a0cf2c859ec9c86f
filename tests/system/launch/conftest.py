"""The `slurm_cluster` fixture: a real two-node Slurm cluster on this machine (tools/env/slurm_cluster.sh), started once
per test session for the tests marked `slurm`, in a state directory of the session's own, and stopped at its end.

The start (on a fresh machine: apt-get install, MariaDB's first start; a minute or more, mostly waiting on disk and
network) begins in the background as soon as collection has found a `slurm` test, so it overlaps the tests that run
before them; the fixture waits for it. A session that never reaches the fixture stops the cluster at its end. Under
xdist (tools/run_tests.sh) the worker that runs the `slurm` tests starts it when the first one needs it: they form one
unit, sent out first, while the other worker runs other tests.

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

REPO = Path(__file__).resolve().parents[3]
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


class _Cluster:
    """One `tools/env/slurm_cluster.sh start`, begun in the background, in a state directory of its own."""

    def __init__(self) -> None:
        # a directory of our own, not under pytest's basetemp: pytest deletes all but the newest 3 of those when any
        # other session starts, and the cluster's state (pid files, config) went with it once; short, too, for the
        # munge socket's path (108 bytes at most)
        self.state = Path(tempfile.mkdtemp(prefix="mrlvr-slurm-", dir="/tmp"))
        self.env = {**os.environ, "MEGATRON_RLVR_SLURM_DIR": str(self.state)}
        self.conf = self.state / "etc" / "slurm.conf"
        self.log = open(self.state / "start.log", "w+")
        self.start = subprocess.Popen(
            ["bash", str(CLUSTER_SCRIPT), "start"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT, text=True
        )

    def wait_up(self) -> str:
        """The start's output; raises when it failed or did not finish within START_TIMEOUT_S."""
        try:
            status = self.start.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.start.kill()
            status = self.start.wait()
        self.log.seek(0)
        output = self.log.read()
        assert status == 0, f"tools/env/slurm_cluster.sh start failed (status {status}):\n{output}"
        return output

    def stop(self) -> str:
        try:  # a session ending while the start still runs: let it end (killing apt-get mid-install breaks dpkg)
            self.start.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.start.kill()
            self.start.wait()
        stop = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "stop"], env=self.env, capture_output=True, text=True, timeout=120
        )
        self.log.close()
        if stop.returncode == 0:
            shutil.rmtree(self.state, ignore_errors=True)
        return stop.stdout + stop.stderr


_background: list[_Cluster] = []  # the session's cluster, once collection has started it


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    # an xdist worker: every worker collects every test, and only the one that runs the `slurm` tests (one unit,
    # tests/parallel.py, sent out first) needs the cluster; its fixture starts it
    if hasattr(session.config, "workerinput"):
        return
    if any(item.get_closest_marker("slurm") for item in session.items) and cannot_make_a_cluster() is None:
        _background.append(_Cluster())


def pytest_sessionfinish(session, exitstatus):
    while _background:  # started but never handed to a test (every slurm test deselected, skipped or not reached)
        print(_background.pop().stop())


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of the running cluster (also exported to os.environ for the session)."""
    reason = cannot_make_a_cluster()
    if reason:
        pytest.skip(reason)
    cluster = _background.pop() if _background else _Cluster()
    old = os.environ.get("SLURM_CONF")
    try:
        print(cluster.wait_up())
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster.conf
    finally:
        print(cluster.stop())
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
