"""How the suite shares the machine's cores: `tools/run_tests.sh` runs it on pytest-xdist workers
(`-n 3 --dist loadgroup` on the machine's 2 cores), and this plugin says which tests must share a worker and in
what order the work goes out.

- **Units of work.** A test file is one unit: its module-scoped fixtures (a converted model, a worker group's
  state, an engine) are made once, in one worker. Tests that share an expensive session fixture form one unit across
  files (`SHARED`: the local Slurm cluster, the converted real model), so it is made once per run. A test marked
  `xdist_group(name)` joins that unit instead (tests/system/docs: the quick start's demo and the blocks that read its
  outputs form one unit; every other docs block is a unit of its own).
- **Order.** Units go out longest first (an estimate from markers, `cost`), so that the long ones start early and the
  short ones fill the end of the workers' queues evenly.
- **Alone.** A unit in `ALONE` (the real model: its layouts hold up to ~18 GB in 6 processes) goes out first, and
  starts only when no other worker runs anything but light units; while it runs, the others take light units only.
  A light unit is one whose tests are all unit-tier (one process) or marked `small` (a few short processes that
  hold little memory together: command-line checks that stop before any rank or engine starts). Beside the real
  model, a Slurm job's preflight once found 0.5 GB free and failed; and the unit tier alone (about 110 s) ends
  before the real model's unit (about 200 s), so without the `small` ones the other workers waited idle.

The workers know the markers; xdist's scheduler, in the controlling process, sees only test ids. Each worker writes
each test's unit to a file the controller named (`pytest_configure_node`), and `UnitScheduling` reads it. (xdist's
own loadgroup appends the group to the test id, which pytest 9.2's structured ids no longer carry: it would
silently spread every unit over the workers.)

Without xdist (plain `pytest`), nothing changes: every test runs in collection order in one process.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

# Session fixtures that cost a minute or more to make: every file whose tests use one runs in one worker.
SHARED = {
    "slurm_cluster": "slurm-cluster",
    "smollm2_hf_dir": "real-model",
    "smollm2_gguf_reference": "real-model",
    "smollm2_chat_batch": "real-model",
}

# Units that need the machine's memory to themselves (see the module's docstring)
ALONE = {"real-model"}

# Seconds a test takes on a 2-core machine, roughly, by what it does: only the order of the units depends on it.
_COST = (("slurm", 60.0), ("docs", 15.0), ("slow", 10.0), ("engine", 3.0), ("dist", 2.0))
_SHARED_COST = 10.0
_BASE_COST = 0.3
_UNITS_KEY = "megatron_rlvr_test_units"  # workerinput: the file each worker writes the units to


def cost(item: pytest.Item) -> float:
    """A rough estimate of the test's seconds; 0 for a test skipped by its marks."""
    if item.get_closest_marker("skip") or any(m.args and m.args[0] for m in item.iter_markers("skipif")):
        return 0.0
    markers = {m.name for m in item.iter_markers()}
    seconds = _BASE_COST + sum(s for name, s in _COST if name in markers)
    if SHARED.keys() & set(getattr(item, "fixturenames", ())):
        seconds += _SHARED_COST
    return seconds


def units(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """Each test's unit of work (see the module's docstring)."""
    shared_by_file: dict[Path, str] = {}
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in SHARED:
                shared_by_file.setdefault(item.path, SHARED[fixture])
    found = {}
    for item in items:
        own = item.get_closest_marker("xdist_group")
        if own is not None:
            found[item] = str(own.args[0] if own.args else own.kwargs["name"])
        else:
            found[item] = shared_by_file.get(item.path) or item.nodeid.split("::", 1)[0]
    return found


def light_test(item: pytest.Item) -> bool:
    """Whether ``item`` may run beside an `ALONE` unit: a unit-tier test, or one marked `small`."""
    return item.get_closest_marker("unit") is not None or item.get_closest_marker("small") is not None


# ---------------------------------------------------------------------------------------------------------------
# In the workers: the longest units first, and each test's unit written for the controller


@pytest.hookimpl(trylast=True)  # after the tiers' and -k/-m's deselection: order what runs
def pytest_collection_modifyitems(config, items):
    if _UNITS_KEY not in getattr(config, "workerinput", {}):
        return
    unit = units(items)
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(unit[item], []).append(item)
    # the `ALONE` units first, while every worker is free to give them the machine, then the longest first; each
    # unit's tests stay in their collection order
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] not in ALONE, -sum(cost(t) for t in kv[1])))
    ordered = [tests for _, tests in ordered]
    items[:] = [item for tests in ordered for item in tests]


@pytest.hookimpl(tryfirst=True)  # before xdist sends the collected ids to the controller
def pytest_collection_finish(session):
    path = getattr(session.config, "workerinput", {}).get(_UNITS_KEY)
    if path is None:
        return
    unit = units(session.items)
    heavy = {unit[item] for item in session.items if not light_test(item)}
    light = sorted(set(unit.values()) - heavy)  # units of light tests alone
    mine = Path(f"{path}.{os.getpid()}")
    mine.write_text(json.dumps({"units": {item.nodeid: unit[item] for item in session.items}, "light": light}))
    mine.replace(path)  # every worker collects the same tests: whichever writes last, the file is whole


# ---------------------------------------------------------------------------------------------------------------
# In the controller: xdist's scheduler, by unit


_units_path = pytest.StashKey[str]()


def pytest_configure(config):
    controller = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if controller and config.getoption("dist", "no") == "loadgroup":
        fd, path = tempfile.mkstemp(prefix="megatron-rlvr-test-units-", suffix=".json")
        os.close(fd)
        config.stash[_units_path] = path


def pytest_unconfigure(config):
    path = config.stash.get(_units_path, None)
    if path:
        Path(path).unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    path = node.config.stash.get(_units_path, None)
    if path:
        node.workerinput[_UNITS_KEY] = path


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    path = config.stash.get(_units_path, None)
    return None if path is None else unit_scheduling(config, log, path)


def unit_scheduling(config, log, path: str):
    """xdist's scheduler over the units the workers wrote to ``path``."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with this plugin's units as the scopes, in the workers' order (longest first),
        and the `ALONE` units run beside light units only."""

        def __init__(self, config, log=None):
            config.option.loadscopereorder = False  # keep the workers' order (longest first), not the test counts'
            super().__init__(config, log)
            self._units: dict[str, str] | None = None
            self._light: set[str] = set()

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:
                found = json.loads(Path(path).read_text())
                self._units, self._light = found["units"], set(found["light"])
            return self._units.get(nodeid) or nodeid.split("::", 1)[0]

        def _running(self, node) -> set[str]:
            """The units with tests still to run on ``node``."""
            return {scope for scope, tests in self.assigned_work.get(node, {}).items() if not all(tests.values())}

        def _pick(self, node) -> str | None:
            """The next unit for ``node``: the first in the queue that may run beside what runs on the other workers.
            What runs on ``node`` itself does not hold it back: a unit sent to it starts after those, and a worker
            waits for its next test before it runs the last one it holds (xdist's teardown needs the next item), so
            a worker held back by its own unit would never finish that unit."""
            elsewhere = set().union(*(self._running(n) for n in self.nodes if n is not node))
            alone_running = bool(elsewhere & ALONE)
            heavy_elsewhere = bool(elsewhere - self._light)
            for scope in self.workqueue:
                if scope in ALONE:
                    if not (alone_running or heavy_elsewhere):  # this node's own tests run before it, not beside
                        return scope
                elif scope in self._light or not alone_running:
                    return scope
            return None

        def _assign_work_unit(self, node) -> None:
            scope = self._pick(node)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def mark_test_complete(self, node, item_index, duration=0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a worker held back by what ran here may go on now (or shut down)
                if other is not node:
                    self._reschedule(other)  # which sends work only to a worker with at most two tests left

    return UnitScheduling(config, log)
