"""Every command block of README.md and docs/*.md runs as written (docs/development.md, "Documented commands").

- every ``bash`` block says where it runs (``bash cpu``, ``bash cluster``, ``bash gpu``) and its doc-test
  directives parse and apply (fast: runs with the default suite);
- ``bash cpu`` blocks run, in document order (README.md, then docs/ by name), in ONE scratch copy of the
  repository's tracked files (``.venv`` a symlink to the real one), with the overrides written beside them in the
  doc; a block fails on a non-zero exit or an ``error:`` line, and the failure names its file and line. The quick
  start's small demo run (README.md) leaves ``outputs/demo`` for the blocks after it, as it does for a reader;
- ``bash cluster`` / ``bash gpu`` blocks are checked without running: ``bash -n``; every recipe they name loads
  with ``load_config`` (with the command's overrides) and ``megatron-rlvr plan`` runs on a training recipe; a
  launcher command runs with ``--dryrun``.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.system.docs.blocks import KINDS, REPO, Block, DocTestError, all_blocks, commands

BLOCKS = all_blocks()
CPU = [b for b in BLOCKS if b.kind == "cpu"]
SYNTAX_ONLY = [b for b in BLOCKS if b.kind in ("cluster", "gpu")]
ERROR_LINE = re.compile(r"^\s*error:", re.MULTILINE)
TAIL_LINES = 40
# What the quick start's demo (README.md) leaves for the pages after it
DEMO_OUTPUTS = re.compile(r"outputs/demo(?![\w.-])")


def _params(blocks: list[Block]) -> list:
    """One test per block, skipped at collection when its directives say so. Under xdist (tests/parallel.py) the
    README's blocks and the blocks that read what they leave run in one worker, in document order; every other block
    is a unit of its own and must not need another block's outputs."""
    params = []
    for b in blocks:
        marks = []
        if b.skip:
            marks.append(pytest.mark.skip(reason=f"{b.where}: {b.skip}"))
        elif b.long and b.kind == "cpu":  # a cluster or gpu block is only syntax-checked: never long
            marks.append(
                pytest.mark.skipif(
                    os.environ.get("DOC_TEST_LONG") != "1",
                    reason=f"{b.where}: long (DOC_TEST_LONG=1 runs it): {b.long}",
                )
            )
        together = b.path == "README.md" or DEMO_OUTPUTS.search(b.text)
        marks.append(pytest.mark.xdist_group("docs README.md" if together else f"docs {b.where}"))
        params.append(pytest.param(b, marks=marks, id=b.where))
    return params


@pytest.mark.docs
def test_every_command_block_says_where_it_runs_and_its_overrides_apply():
    problems = []
    for block in BLOCKS:
        if block.kind == "":
            problems.append(f"{block.where}: ```{block.info}: expected ```bash {' | '.join(KINDS)}")
            continue
        if block.kind == "other":
            if block.subs or block.skip or block.long:
                problems.append(f"{block.where}: doc-test directives on a ```{block.info} block, which never runs")
            continue
        try:
            text = block.runnable_text()
        except DocTestError as e:
            problems.append(str(e))
            continue
        if block.kind == "cpu" and not block.skip and "setup_env.sh" in text:
            # its `pip install -e .` would re-point the shared editable install at the scratch copy
            problems.append(
                f"{block.where}: runs tools/env/setup_env.sh; skip it or sub it out with a doc-test directive"
            )
    assert not problems, "\n".join(problems)
    assert CPU and SYNTAX_ONLY  # the docs show both kinds; none found means the parser broke


# ---------------------------------------------------------------------------------------------------------------
# The scratch copy the cpu blocks share


def _tracked_files() -> list[str]:
    """The files a clone of this working tree would have: tracked ones, and new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return [p for p in out.decode().split("\0") if p]


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> Path:
    """A fresh-clone stand-in: the tracked files, the built extension, .venv linked to the real environment. One per
    session (per xdist worker), kept while other files' tests run between the blocks."""
    root = tmp_path_factory.mktemp("doc_commands") / "repo"
    for rel in _tracked_files():
        src = REPO / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    for so in (REPO / "megatron_rlvr").glob("_C*.so"):  # built by tools/env/setup_env.sh, not tracked
        shutil.copy2(so, root / "megatron_rlvr" / so.name)
    # a repository, as a clone is: the Slurm launcher's dry run packs the job from git (nemo-run's packager)
    git = ["git", "-c", "user.name=doc-test", "-c", "user.email=doc-test@localhost", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "scratch copy for tests/docs"]):
        subprocess.run(git + args, cwd=root, check=True, capture_output=True)
    venv = (REPO / ".venv").resolve()
    if not (venv / "bin" / "python").exists():
        pytest.fail(f"{REPO / '.venv'}: no virtual environment; run the quick start (tools/env/setup_env.sh) first")
    (root / ".venv").symlink_to(venv)
    found = subprocess.run(
        [str(root / ".venv/bin/python"), "-c", "import megatron_rlvr; print(megatron_rlvr.__file__)"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(found).resolve().is_relative_to(root.resolve()), (
        f"the scratch copy imports {found}, not its own package"
    )
    return root


def _env(root: Path, activated: bool = False) -> dict[str, str]:
    # PYTHONPATH makes the scratch copy's package win over the shared editable install, as a clone's own would
    # NEMORUN_HOME: the launchers' experiment records stay in the scratch copy, not in ~/.nemo_run
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", NEMORUN_HOME=str(root / "outputs" / "nemo_run"))
    if activated:  # the cluster page's commands run after `source .venv/bin/activate`
        env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(script: str, root: Path, timeout: float, activated: bool = False) -> tuple[int, str, float, float]:
    """Run ``script`` with bash -e in ``root``: (exit status, output, wall seconds, CPU seconds of its processes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # a session of its own: on a timeout the whole block (torchrun, its ranks, engines) is killed, not only bash
    proc = subprocess.Popen(
        ["bash", "-c", "set -eo pipefail\n" + script],
        cwd=root,
        env=_env(root, activated),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status, output = 124, output + f"\n(timed out after {timeout:.0f} s)"
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return status, output, time.perf_counter() - start, cpu


def _check(block: Block, what: str, status: int, output: str) -> None:
    error = ERROR_LINE.search(output)
    if status == 0 and error is None:
        return
    tail = "\n".join(output.rstrip().split("\n")[-TAIL_LINES:])
    reason = f"exit {status}" if status else f"an error line: {output[error.start() :].splitlines()[0].strip()}"
    pytest.fail(f"{block.where}: {what} failed ({reason})\n--- last lines ---\n{tail}", pytrace=False)


def _report(block: Block, result: str, wall: float, cpu: float) -> None:
    print(f"[doc-test] {block.where} {result} {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.docs
@pytest.mark.parametrize("block", _params(CPU))
def test_cpu_block_runs(block: Block, scratch: Path):
    status, output, wall, cpu = _run(block.runnable_text(), scratch, block.timeout)
    _report(block, "pass" if status == 0 and not ERROR_LINE.search(output) else "FAIL", wall, cpu)
    _check(block, "the block", status, output)


# ---------------------------------------------------------------------------------------------------------------
# cluster / gpu blocks: syntax, recipes, plans and launcher dry runs


_LAUNCHERS = ("launch/train.py", "launch/eval.py", "launch/convert.py")


def _recipe_uses(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(recipe, overrides) named by a command: ``--recipe NAME`` or ``megatron-rlvr plan NAME``."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and "." in a.split("=", 1)[0]]
    names = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipe"]
    names += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "plan" and "megatron-rlvr" in " ".join(argv[:i])]
    return [(n, overrides) for n in names]


def _dry_run_argv(argv: list[str]) -> list[str]:
    argv = [a for a in argv if a != "--detach"]  # --detach submits and returns; a dry run never submits
    if "--dryrun" not in argv:
        cut = argv.index("--") if "--" in argv else len(argv)  # launch/convert.py: flags after -- are the tool's
        argv = argv[:cut] + ["--dryrun"] + argv[cut:]
    return argv


@pytest.mark.slow
@pytest.mark.docs
@pytest.mark.small  # in this process: bash -n, recipes, plans and launcher dry runs (tests/parallel.py)
@pytest.mark.parametrize("block", _params(SYNTAX_ONLY))
def test_cluster_and_gpu_blocks_parse_and_their_recipes_plan(block: Block, scratch: Path):
    syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    _check(block, "bash -n", syntax.returncode, syntax.stderr)
    from launch.recipes import find_recipe
    from megatron_rlvr.config import load_config

    wall = cpu = 0.0
    for command in commands(block.text):
        argv = shlex.split(command, comments=True)
        for name, overrides in _recipe_uses(argv):
            try:
                load_config(find_recipe(name), overrides)
            except Exception as e:  # noqa: BLE001  # any failure to load is the finding
                pytest.fail(f"{block.where}: recipe {name} {' '.join(overrides)} does not load: {e}", pytrace=False)
            if not name.startswith("eval"):  # a training recipe: its layout must fit before it is queued
                plan = shlex.join([".venv/bin/megatron-rlvr", "plan", name, *overrides]) + " || test $? -eq 3"
                status, output, w, c = _run(plan, scratch, 300)
                wall, cpu = wall + w, cpu + c
                _check(block, f"megatron-rlvr plan {name}", status, output)
        if any(a in _LAUNCHERS for a in argv):
            status, output, w, c = _run(shlex.join(_dry_run_argv(argv)), scratch, 300, activated=True)
            wall, cpu = wall + w, cpu + c
            _check(block, "the launcher's --dryrun", status, output)
    _report(block, "syntax-checked", wall, cpu)
