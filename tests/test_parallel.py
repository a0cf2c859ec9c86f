"""The suite's scheduler over xdist workers (tests/parallel.py), driven with two stand-in workers: a unit's tests go
to one worker, in the queue's order, and an `ALONE` unit runs beside unit-tier tests only."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.parallel import ALONE, unit_scheduling

(REAL_MODEL,) = ALONE


class Worker:
    """What the scheduler uses of an xdist worker: the tests it was sent, by index into the collection."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(tmp_path, units: dict[str, str], light: list[str]):
    path = tmp_path / "units.json"
    path.write_text(json.dumps({"units": units, "light": light}))
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue=lambda name: ["2*popen"])
    sched = unit_scheduling(config, None, str(path))
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, list(units))
    sched.schedule()
    return sched, workers


def _finish(sched, worker: Worker, units: dict[str, str]) -> None:
    """The worker runs every test it holds."""
    for index in list(worker.sent):
        nodeid = list(units)[index]
        if not sched.assigned_work[worker][units[nodeid]][nodeid]:
            sched.mark_test_complete(worker, index)


def test_units_stay_whole_and_an_alone_unit_runs_beside_light_ones_only(tmp_path):
    units = {
        "test_real_model.py::a": REAL_MODEL,  # the workers put it first
        "bridge/test_gguf.py::b": REAL_MODEL,
        "test_heavy.py::a": "test_heavy.py",
        "test_heavy.py::b": "test_heavy.py",
        "test_light.py::a": "test_light.py",
        "test_light.py::b": "test_light.py",
        "test_light.py::c": "test_light.py",
    }
    ids = list(units)
    sched, (gw0, gw1) = _scheduler(tmp_path, units, light=["test_light.py"])
    assert [ids[i] for i in gw0.sent] == ids[:2]  # the real model's unit, whole, on one worker
    assert [ids[i] for i in gw1.sent] == ids[4:]  # beside it, the light unit; the heavy one waits
    _finish(sched, gw1, units)
    assert [ids[i] for i in gw1.sent] == ids[4:]  # still waiting: the real model runs
    _finish(sched, gw0, units)  # done: the idle worker goes on
    assert sorted(ids[i] for i in gw0.sent + gw1.sent) == sorted(ids)
    assert not sched.workqueue


def test_an_alone_unit_waits_for_the_heavy_units_that_run(tmp_path):
    units = {
        "test_heavy.py::a": "test_heavy.py",
        "test_heavy.py::b": "test_heavy.py",
        "test_heavy.py::c": "test_heavy.py",
        "test_real_model.py::a": REAL_MODEL,
        "test_other.py::a": "test_other.py",
    }
    ids = list(units)
    sched, (gw0, gw1) = _scheduler(tmp_path, units, light=[])
    assert [ids[i] for i in gw0.sent] == ids[:3]
    assert [ids[i] for i in gw1.sent] == ["test_other.py::a"]  # not the real model beside a heavy unit
    _finish(sched, gw1, units)
    assert [ids[i] for i in gw1.sent] == ["test_other.py::a"]
    _finish(sched, gw0, units)
    assert "test_real_model.py::a" in [ids[i] for i in gw0.sent + gw1.sent]
