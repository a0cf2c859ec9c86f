"""Where a job runs: the local (torchrun), Slurm H200 and local-Slurm CPU (`launch/slurm_local.py`) executors, and
the one runner every launch script calls.

`launch/train.py`, `eval.py` and `convert.py` differ only in the `megatron-rlvr` subcommand they start; this module
turns their checked options (`launch/options.py`) into a nemo-run executor, runs the experiment, and converts the
outcome into an exit status. nemo-run does not
raise when a task fails, so `run_task` reads the task's final state and returns non-zero itself.

nemo-run reads NEMORUN_HOME once, at import time (its schedulers keep job registries under it), so nothing here
imports nemo_run before `_import_nemo_run` has put `--nemorun-home` into the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launch.options import H200_GPUS_PER_NODE, SLURM_EXECUTORS, LaunchError, LaunchOptions, signal_env

# The task's package: torchrun starts `python -m megatron_rlvr.cli <subcommand> ...` on every rank.
CLI_MODULE = "megatron_rlvr.cli"
# Local jobs start torchrun as `python -m megatron_rlvr.runtime.console ARGS`: torchrun that ends the job on a rank's
# user error with that one line and exit status 2, without torchrun's report (docs/development.md).
CONSOLE_MODULE = "megatron_rlvr.runtime.console"
# Where a Slurm job sees the nemo-run job directory (code/, configs/) inside its container; fixed by nemo-run.
CONTAINER_RUN_DIR = "/nemo_run"
REPO_ROOT = Path(__file__).resolve().parent.parent
_PLACEHOLDER = "@shipped:"

# Environment every H200 rank gets. Values are the usual megatron-core / NeMo settings on NVLink + InfiniBand
# nodes; each can be overridden with --env KEY=VALUE.
H200_ENV = {
    # megatron's sequence-parallel / TP overlap needs kernels queued in issue order on one hardware queue
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # frees NCCL buffers eagerly instead of through recordStream (lower peak memory with colocated vLLM)
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    # NVLink SHARP buffers cost GPU memory that the colocated rollout engine needs more
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # compute nodes have no internet: never wait on a hub
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


# ---------------------------------------------------------------------------------------------------------------
# Executors


def _import_nemo_run(opts: LaunchOptions) -> Any:
    if opts.nemorun_home:
        os.environ["NEMORUN_HOME"] = str(Path(opts.nemorun_home).expanduser().resolve())
    with warnings.catch_warnings():  # its web-server dependencies announce deprecations at import
        warnings.simplefilter("ignore")
        import nemo_run

    return nemo_run


def local_executor(opts: LaunchOptions, run: Any, launcher: str | None = "torchrun") -> Any:
    """One plain process on this machine: the task itself, or (torchrun) `CONSOLE_MODULE` starting
    `procs_per_node` ranks (gloo on CPU, NCCL on GPUs); `run_task` makes the task."""
    # nemo-run starts `python` from PATH, and torchrun starts the ranks with that interpreter: make it this one
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    env = {"PYTHONUNBUFFERED": "1", **opts.env}
    return run.LocalExecutor(ntasks_per_node=1, launcher=None, env_vars=env)


def slurm_h200_executor(
    opts: LaunchOptions, run: Any, launcher: str | None = "torchrun", preemptible: bool = False
) -> Any:
    """`nodes` exclusive H200 nodes, one torchrun per node starting 8 ranks, inside a pyxis container
    (without a launcher: srun starts `procs_per_node` plain processes per node). A `preemptible` job (training)
    asks for `opts.signal` before the time limit; other jobs would die of it, so they ask for none."""
    from launch.slurm_local import stop_requeue_lines

    if opts.tunnel == "ssh":
        tunnel = run.SSHTunnel(
            host=opts.ssh_host, user=opts.ssh_user, job_dir=opts.remote_job_dir, identity=opts.ssh_identity
        )
    else:
        # job_dir "" = under NEMORUN_HOME, which must then be on the filesystem the compute nodes share
        tunnel = run.LocalTunnel(job_dir="")
    # git: the job's working directory /nemo_run/code holds the shipped repo, and `python -m` puts the working
    # directory first on sys.path, so it shadows any megatron-rlvr installed in the image; image: that dir is empty.
    packager = run.GitArchivePackager() if opts.code == "git" else run.Packager()
    warn = preemptible and opts.signal is not None
    return run.SlurmExecutor(
        account=opts.account,
        partition=opts.partition,
        time=opts.time,
        nodes=opts.nodes,
        ntasks_per_node=opts.procs_per_node,
        gpus_per_node=H200_GPUS_PER_NODE,
        exclusive=True,
        mem="0",  # all of the node's memory: colocated vLLM + megatron ranks share it
        container_image=opts.container_image,
        container_mounts=list(opts.mounts),
        signal=opts.signal if warn else None,
        env_vars={**H200_ENV, **(signal_env(opts.signal) if warn else {}), **opts.env},
        # the job directory is mounted at CONTAINER_RUN_DIR: the ranks' stop marker lands where the batch shell looks
        setup_lines=stop_requeue_lines(CONTAINER_RUN_DIR) if warn else None,
        tunnel=tunnel,
        packager=packager,
        launcher=launcher,
        retries=opts.retries,
        job_name_prefix="megatron-rlvr-",
    )


def make_executor(opts: LaunchOptions, run: Any, launcher: str | None = "torchrun", preemptible: bool = False) -> Any:
    if opts.executor == "local":
        return local_executor(opts, run, launcher)
    if opts.executor == "slurm_local":
        from launch.slurm_local import slurm_local_executor

        warn = preemptible and opts.signal is not None
        return slurm_local_executor(
            opts, run, REPO_ROOT, launcher, preemptible, signal_env(opts.signal) if warn else None
        )
    return slurm_h200_executor(opts, run, launcher, preemptible)


# ---------------------------------------------------------------------------------------------------------------
# Running


def file_placeholder(name: str) -> str:
    """A task argument that `run_task` replaces by the path of shipped file `name` as the ranks see it."""
    return f"{_PLACEHOLDER}{name}"


def _ship_locally(files: dict[str, str], name: str) -> dict[str, str]:
    """Local jobs read this machine's files: write them under NEMORUN_HOME and return their paths."""
    from nemo_run.config import get_nemorun_home

    folder = Path(get_nemorun_home()) / "shipped" / f"{name}_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for file_name, text in files.items():
        (folder / file_name).write_text(text)
        paths[file_name] = str(folder / file_name)
    return paths


def run_task(
    name: str,
    cli_args: Sequence[str],
    opts: LaunchOptions,
    ship: dict[str, str] | None = None,
    module: str = CLI_MODULE,
    launcher: str | None = "torchrun",
) -> int:
    """Run `python -m <module> <cli_args>` (normally megatron_rlvr.cli) under torchrun; 0 = success.

    `ship` maps file names to contents the job needs (the resolved run config); an argument
    `file_placeholder(name)` in `cli_args` becomes that file's path as the ranks see it. On Slurm the files travel
    in the job directory (written by the packager, when nemo-run writes its own job files); locally they are
    written under NEMORUN_HOME. With `opts.dryrun` the job script is printed instead of run; a dry run without a
    nemo-run home (`--nemorun-home` or $NEMORUN_HOME) writes nemo-run's files into a temporary directory and removes
    it, so it leaves nothing behind (with one, they stay there, as a submission writes them). `launcher=None`
    starts the module as plain processes (single-process tools such as convert).
    """
    if not opts.dryrun or opts.nemorun_home:
        return _run_task(name, cli_args, opts, dict(ship or {}), module, launcher, keep=True)
    scratch = tempfile.mkdtemp(prefix="megatron-rlvr-dryrun-")
    try:
        scratch_opts = dataclasses.replace(opts, nemorun_home=scratch)
        return _run_task(name, cli_args, scratch_opts, dict(ship or {}), module, launcher, keep=False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_task(
    name: str,
    cli_args: Sequence[str],
    opts: LaunchOptions,
    ship: dict[str, str],
    module: str,
    launcher: str | None,
    keep: bool,
) -> int:
    """`run_task` with its nemo-run home decided; `keep`: a dry run's files stay there (else it is temporary)."""
    run = _import_nemo_run(opts)
    # the git packager archives the repository of the current directory, and local ranks start here too
    os.chdir(REPO_ROOT)
    # only `megatron-rlvr train` stops cleanly on the warning signal (megatron_rlvr/runtime/preemption.py)
    executor = make_executor(opts, run, launcher, preemptible=module == CLI_MODULE and cli_args[:1] == ["train"])
    if opts.executor in ("local", "slurm_local"):  # slurm_local: the nodes share this machine's NEMORUN_HOME
        paths = _ship_locally(ship, name) if ship else {}
    else:
        from launch.shipping import with_shipped_files

        executor.packager = with_shipped_files(executor.packager, ship)
        paths = {n: f"{CONTAINER_RUN_DIR}/configs/{n}" for n in ship}
    args = [paths[a[len(_PLACEHOLDER) :]] if a.startswith(_PLACEHOLDER) else a for a in cli_args]
    if launcher == "torchrun" and any(a.startswith("-") for a in args):
        # torchrun's parser sees the task's options too and refuses an abbreviation of its own (eval's `--n`:
        # "ambiguous option: --n could match --nnodes, ..."); after `--` they are the task's alone
        args = ["--", *args]
    if launcher == "torchrun" and opts.executor == "local":
        args = ["--standalone", f"--nproc-per-node={opts.procs_per_node}", "-m", module, *args]
        module = CONSOLE_MODULE
    task = run.Script(path=module, m=True, entrypoint="python", args=args)
    detach = opts.detach and opts.executor != "local"
    stop_relay = contextlib.ExitStack()  # left after the Experiment: around nemo-run's wait for the task
    with stop_relay, run.Experiment(opts.job_name or name, executor=executor, log_level="WARN") as exp:
        exp.add(task, executor=executor, name=name)
        if opts.dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            print(dryrun_script(exp, opts, module, launcher, kept=keep, shipped=ship))
            return 0
        exp.run(detach=detach, tail_logs=not detach)
        if opts.executor == "local":
            # SIGTERM / Ctrl-C go to the task (its own session: it got neither), which passes them to the ranks and
            # waits for their checkpoint (megatron_rlvr/runtime/stop_relay.py); nemo-run keeps waiting for it, in
            # place of its scheduler's handlers, which would end the task 10 s later
            from megatron_rlvr.runtime.stop_relay import child_pids, forwarding

            stop_relay.enter_context(forwarding(child_pids))
    # leaving the `with` block is where nemo-run waits for the tasks and records their final state
    return exit_status(exp, detached=detach)


def dryrun_script(
    exp: Any,
    opts: LaunchOptions,
    module: str = CLI_MODULE,
    launcher: str | None = "torchrun",
    kept: bool = True,
    shipped: dict[str, str] | None = None,
) -> str:
    """The job script a dry run produced: nemo-run's sbatch file for Slurm, the torchrun line locally. `kept`:
    nemo-run's files stay where the script's header says; else they were written to a temporary directory (removed
    when the dry run ends): the header says so, and a line after the script says what each shipped file held."""
    job = exp.jobs[0]
    note = (
        ""
        if kept
        else " (a dry run without --nemorun-home or $NEMORUN_HOME keeps no files: this was written to a temporary "
        "directory, now removed)"
    )
    if opts.executor in SLURM_EXECUTORS:
        path = Path(job.executor.experiment_dir) / f"{job.executor.job_name}_sbatch.sh"
        if not path.is_file():
            raise LaunchError(f"dry run: nemo-run wrote no sbatch script at {path}")
        script = (
            f"# sbatch script: {path}\n{path.read_text()}" if kept else f"# sbatch script{note}\n{path.read_text()}"
        )
    else:
        args = shlex.join(job.task.args)
        if launcher is None:
            script = f"# local executor: one process{note}\npython -m {module} {args}"
        else:  # torchrun through CONSOLE_MODULE (its task's module and arguments)
            script = f"# local executor: {opts.procs_per_node} processes (torchrun){note}\npython -m {module} {args}"
    if kept:
        return script
    for file_name, text in (shipped or {}).items():  # its first line says what it holds (launch/recipes.py)
        script += f"\n# {file_name}, shipped with the job: {text.splitlines()[0].lstrip('# ')}"
    return script


_SUCCESS = "SUCCEEDED"
_SUBMITTED_OK = ("SUBMITTED", "PENDING", "RUNNING", "SUCCEEDED")


def exit_status(exp: Any, detached: bool = False) -> int:
    """0 when every task succeeded (or, detached, was accepted by Slurm); 2 with its one line when a local task
    stopped on a user error; 1 otherwise, naming the failed task."""
    failed = []
    for job in exp.jobs:
        state = job.state.name if hasattr(job.state, "name") else str(job.state)
        ok = state in _SUBMITTED_OK if detached else state == _SUCCESS
        if not ok:
            failed.append(f"{job.id}: {state}")
    user_error = _user_error_line(exp) if failed else None
    if user_error:
        print(user_error, file=sys.stderr)
        return 2
    if failed:
        logs = exp.jobs[0].executor.job_dir if exp.jobs else "?"
        print(f"[launch] task failed: {'; '.join(failed)} (logs: {logs})", file=sys.stderr)
        return 1
    return 0


def _user_error_line(exp: Any) -> str | None:
    """The ``error: ...`` line a local task left in its error file when it stopped on a user error (the console's
    torchrun, or a plain `megatron_rlvr.cli` process, writes it to $TORCHELASTIC_ERROR_FILE, which nemo-run's local
    scheduler gives each task as ``<job dir>/nemo_run/<app>/<role>/<replica>/error.json``), or None."""
    import json

    for job in exp.jobs:
        for path in sorted(Path(job.executor.job_dir).glob("nemo_run/*/*/*/error.json")):
            try:
                message = json.loads(path.read_text()).get("message")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(message, str) and message.startswith("error: "):
                return message
    return None
