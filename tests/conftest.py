"""Shared pytest fixtures: reusable gloo worker groups (spawning a process that imports megatron costs seconds), and
the real pretrained model converted once per session (tests/support/real_model.py). The suite's tiers and `--tier` are
tests/tiers.py; how it shares the cores over xdist workers, tests/parallel.py."""

from __future__ import annotations

import os

import pytest

# Tests run with one intra-op thread per process: the machine has 2 cores and multi-process tests share them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_rlvr.testing.workers import WorkerGroup, fork_from_a_preloaded_server  # noqa: E402

# Every group of the session forks its workers from one process that imported torch and megatron.core once: the
# suite starts dozens of groups, and a spawned worker spent ~6 s of CPU on those imports.
fork_from_a_preloaded_server()

pytest_plugins = ("tests.support.real_model", "tests.tiers", "tests.parallel")

_GROUP_TIMEOUT_S = float(os.environ.get("MEGATRON_RLVR_TEST_TIMEOUT", "300"))


@pytest.fixture(scope="session")
def workers2():
    with WorkerGroup(2, timeout_s=_GROUP_TIMEOUT_S) as group:
        yield group


@pytest.fixture(scope="session")
def workers4():
    with WorkerGroup(4, timeout_s=_GROUP_TIMEOUT_S) as group:
        yield group
