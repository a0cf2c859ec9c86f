"""The suite's scheduler over xdist workers (tests/parallel.py), driven with two or three stand-in workers (the test
command runs three): a unit's tests go to one worker, in the queue's order, an `ALONE` unit runs beside light units
only (unit-tier tests and tests marked `small`), and every run ends: the stand-ins hold their last test until more
work or the shutdown comes, as xdist's workers do."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.parallel import ALONE, light_test, unit_scheduling

(REAL_MODEL,) = ALONE


class Worker:
    """What the scheduler uses of an xdist worker: the tests it was sent, by index into the collection."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.done: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(tmp_path, units: dict[str, str], light: list[str], workers: int = 2):
    path = tmp_path / "units.json"
    path.write_text(json.dumps({"units": units, "light": light}))
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue=lambda name: [f"{workers}*popen"])
    sched = unit_scheduling(config, None, str(path))
    workers = [Worker(f"gw{n}") for n in range(workers)]
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


def _drive(sched, workers: list[Worker]) -> None:
    """The workers run what xdist's would, one test at a time in turn, until none can: a worker runs a test only
    while another follows it in its queue, or once it is shutting down (the worker needs the next item for its
    teardown)."""
    moved = True
    while moved:
        moved = False
        for worker in workers:
            waiting = [i for i in worker.sent if i not in worker.done]
            if len(waiting) > 1 or (waiting and worker.shutting_down):
                worker.done.append(waiting[0])
                sched.mark_test_complete(worker, waiting[0])
                moved = True


def test_every_run_ends_and_the_alone_unit_never_runs_beside_a_heavy_one(tmp_path):
    units = {
        "test_real_model.py::a": REAL_MODEL,  # the workers put it first
        "test_real_model.py::b": REAL_MODEL,
        "test_real_model.py::c": REAL_MODEL,
        **{f"test_heavy{n}.py::{t}": f"test_heavy{n}.py" for n in range(3) for t in "ab"},
        "test_light.py::a": "test_light.py",
    }
    ids = list(units)
    sched, workers = _scheduler(tmp_path, units, light=["test_light.py"])
    gw0, gw1 = workers
    assert [ids[i] for i in gw1.sent] == ["test_light.py::a"]  # not a heavy unit beside the real model
    _drive(sched, workers)
    assert sorted(ids[i] for i in gw0.done + gw1.done) == sorted(ids)  # all ran: nothing waits on the other
    assert gw0.shutting_down and gw1.shutting_down and not sched.workqueue
    assert [ids[i] for i in gw0.done[:3]] == ids[:3]
    assert ids[gw1.sent[0]] == "test_light.py::a"  # while the real model ran, the other worker took the light unit


def test_with_three_workers_the_two_beside_the_alone_unit_share_the_light_units_and_wait(tmp_path):
    units = {
        "test_real_model.py::a": REAL_MODEL,  # the workers put it first
        "test_real_model.py::b": REAL_MODEL,
        **{f"test_heavy{n}.py::a": f"test_heavy{n}.py" for n in range(3)},
        "test_light0.py::a": "test_light0.py",
        "test_light1.py::a": "test_light1.py",
        "test_light2.py::a": "test_light2.py",
    }
    ids = list(units)
    light = [f"test_light{n}.py" for n in range(3)]
    sched, workers = _scheduler(tmp_path, units, light=light, workers=3)
    gw0, gw1, gw2 = workers
    assert [ids[i] for i in gw0.sent[:2]] == ids[:2]
    beside = [ids[i] for i in gw1.sent + gw2.sent]
    assert beside and all(t.startswith("test_light") for t in beside)  # no heavy unit beside the real model
    _finish(sched, gw1, units)
    _finish(sched, gw2, units)
    assert all(ids[i].startswith("test_light") for i in gw1.sent + gw2.sent)  # the light ones done: they wait
    _finish(sched, gw0, units)  # the real model done: the heavy units go out
    _drive(sched, workers)
    assert sorted(ids[i] for w in workers for i in w.sent) == sorted(ids)  # each test sent once: all ran
    assert all(w.shutting_down for w in workers) and not sched.workqueue


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
    assert [ids[i] for i in gw0.sent] == ids[:4]  # the real model's unit, whole, then the heavy one after it
    assert [ids[i] for i in gw1.sent] == ids[4:]  # beside it, the light unit only
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


def test_a_light_test_is_unit_tier_or_marked_small():
    def item(*markers: str):
        return SimpleNamespace(get_closest_marker=lambda name: object() if name in markers else None)

    assert light_test(item("unit")) and light_test(item("small", "slow")) and light_test(item("unit", "small"))
    assert not light_test(item("slow")) and not light_test(item("dist", "engine")) and not light_test(item())
