"""How the suite shares the machine's cores: `tools/run_tests.sh` runs it on pytest-xdist workers
(`-n 2 --dist loadgroup`), and this plugin says which tests must share a worker and in what order the work goes out.

- **Units of work.** A test file is one unit: its module-scoped fixtures (a converted model, a worker group's
  state, an engine) are made once, in one worker. Tests that share an expensive session fixture form one unit across
  files (`SHARED`: the local Slurm cluster, the converted real model), so it is made once per run. A test that says
  its own `xdist_group` keeps it (tests/docs: the quick start's demo and the blocks that read its outputs form one
  unit; every other docs block is a unit of its own).
- **Order.** Units go out longest first (an estimate from markers, `cost`), so that the long ones start early and the
  short ones fill the end of both workers' queues evenly.

Without xdist (plain `pytest`), nothing changes: every test runs in collection order in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Session fixtures that cost a minute or more to make: every file whose tests use one runs in one worker.
SHARED = {
    "slurm_cluster": "slurm-cluster",
    "smollm2_hf_dir": "real-model",
    "smollm2_gguf_reference": "real-model",
    "smollm2_chat_batch": "real-model",
}

# Seconds a test takes on a 2-core machine, roughly, by what it does: only the order of the units depends on it.
_COST = (("slurm", 60.0), ("docs", 15.0), ("slow", 10.0), ("engine", 3.0), ("dist", 2.0))
_REAL_MODEL_COST = 10.0
_BASE_COST = 0.3


def distributed(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker of a `--dist loadgroup` run."""
    return bool(getattr(config.option, "loadgroup", False))  # set by xdist in its workers


def cost(item: pytest.Item) -> float:
    """A rough estimate of the test's seconds; 0 for a test skipped by its marks."""
    if item.get_closest_marker("skip") or any(m.args and m.args[0] for m in item.iter_markers("skipif")):
        return 0.0
    markers = {m.name for m in item.iter_markers()}
    seconds = _BASE_COST + sum(s for name, s in _COST if name in markers)
    if SHARED.keys() & set(getattr(item, "fixturenames", ())):
        seconds += _REAL_MODEL_COST
    return seconds


def _file(item: pytest.Item) -> str:
    return Path(str(item.path)).as_posix()


def group_of(item: pytest.Item, shared_by_file: dict[str, str]) -> str:
    own = item.get_closest_marker("xdist_group")
    if own is not None:
        return own.args[0] if own.args else own.kwargs["name"]
    return shared_by_file.get(_file(item)) or item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if not distributed(config):
        return
    shared_by_file: dict[str, str] = {}
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in SHARED:
                shared_by_file.setdefault(_file(item), SHARED[fixture])
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = group_of(item, shared_by_file)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    # longest first; each group's tests stay in their collection order
    ordered = sorted(groups.values(), key=lambda tests: -sum(cost(t) for t in tests))
    items[:] = [item for tests in ordered for item in tests]
