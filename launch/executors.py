"""Where a job runs: the local (torchrun), Slurm H200 and local-Slurm CPU (`launch/slurm_local.py`) executors, and
the one runner every launch script calls.

`launch/train.py`, `eval.py` and `convert.py` differ only in the `megatron-rlvr` subcommand they start; this module
turns their command-line options (with environment-variable defaults, so a cluster profile can live in a shell rc)
into a nemo-run executor, runs the experiment, and converts the outcome into an exit status. nemo-run does not
raise when a task fails, so `run_task` reads the task's final state and returns non-zero itself.

nemo-run reads NEMORUN_HOME once, at import time (its schedulers keep job registries under it), so nothing here
imports nemo_run before `_import_nemo_run` has put `--nemorun-home` into the environment.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXECUTORS = ("local", "slurm_h200", "slurm_local")
SLURM_EXECUTORS = ("slurm_h200", "slurm_local")
H200_GPUS_PER_NODE = 8
# The task's package: torchrun starts `python -m megatron_rlvr.cli <subcommand> ...` on every rank.
CLI_MODULE = "megatron_rlvr.cli"
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


# Training stops cleanly on this signal (megatron_rlvr/runtime/preemption.py): Slurm sends it to every process of the job
# step this many seconds before the time limit; the run finishes its step, writes a checkpoint and exits.
DEFAULT_SIGNAL = "USR1@300"
# torchrun's own list (its default) plus the warning signal: it forwards them to the ranks instead of dying of one.
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_SIGNAL_RE = re.compile(r"(?:SIG)?([A-Z0-9]+)@(\d+)")
_STOP_SIGNALS = ("USR1", "TERM")  # the ones megatron_rlvr.runtime.preemption handles


class LaunchError(ValueError):
    """A launch option is missing or inconsistent; the message names the option and what was expected."""


@dataclass
class LaunchOptions:
    """Everything about where and how a job runs (not what it computes: that is the run config)."""

    executor: str = "local"
    nodes: int = 1
    nproc_per_node: int | None = None  # default: 2 (local CPU demo) or 8 (one per H200)
    job_name: str = ""
    dryrun: bool = False
    detach: bool = False
    env: dict[str, str] = field(default_factory=dict)
    nemorun_home: str | None = None
    # Slurm
    account: str | None = None
    partition: str | None = None
    time: str = "04:00:00"
    signal: str | None = DEFAULT_SIGNAL  # SIG@SECONDS before the time limit, for training jobs; None: none
    container_image: str | None = None
    mounts: list[str] = field(default_factory=list)
    code: str = "git"  # git: ship the repo's committed HEAD; image: the container already has megatron-rlvr
    tunnel: str = "local"  # local: we are on a login node; ssh: submit from a workstation
    ssh_host: str | None = None
    ssh_user: str | None = None
    ssh_identity: str | None = None
    remote_job_dir: str | None = None
    retries: int = 0  # Slurm: nemo-run requeues a failed job this many times (the rerun resumes from its checkpoint)

    @property
    def procs_per_node(self) -> int:
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        if self.executor == "slurm_h200":
            return H200_GPUS_PER_NODE
        return 1 if self.executor == "slurm_local" else 2  # slurm_local: one rank per node, so gloo crosses nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


# ---------------------------------------------------------------------------------------------------------------
# Command line


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by train/eval/convert. Slurm ones default to environment variables (docs/cluster.md)."""
    env = os.environ.get
    g = parser.add_argument_group("where it runs")
    g.add_argument("--executor", choices=EXECUTORS, default=env("MEGATRON_RLVR_EXECUTOR", "local"))
    g.add_argument("--nodes", type=int, default=1, help="nodes (Slurm); the local executor runs on this machine")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes per node (default: 8 = one per H200 on Slurm, 2 locally)",
    )
    g.add_argument("--name", default="", help="experiment name (default: derived from the recipe)")
    g.add_argument("--dryrun", action="store_true", help="print the job script (sbatch for Slurm) and exit")
    g.add_argument("--detach", action="store_true", help="Slurm: return after submission instead of waiting")
    g.add_argument(
        "--retries",
        type=int,
        default=0,
        help="Slurm: requeue a failed job this many times; training resumes from its last checkpoint",
    )
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeat)")
    g.add_argument(
        "--nemorun-home",
        default=env("NEMORUN_HOME"),
        help="nemo-run's experiment store; on a cluster put it on the shared filesystem [$NEMORUN_HOME]",
    )
    s = parser.add_argument_group("Slurm (H200 nodes, pyxis containers)")
    s.add_argument("--account", default=env("SBATCH_ACCOUNT"), help="[$SBATCH_ACCOUNT]")
    s.add_argument("--partition", default=env("SBATCH_PARTITION"), help="[$SBATCH_PARTITION]")
    s.add_argument("--time", default=env("SBATCH_TIMELIMIT", "04:00:00"), help="[$SBATCH_TIMELIMIT]")
    s.add_argument(
        "--signal",
        default=env("MEGATRON_RLVR_SIGNAL", DEFAULT_SIGNAL),
        metavar="SIG@SECONDS",
        help="training jobs: Slurm sends SIG (USR1 or TERM) to every process of the job this many seconds "
        "before --time runs out; the run finishes its step, checkpoints and exits, and rerunning "
        "the same launch command resumes. 'none': no warning [$MEGATRON_RLVR_SIGNAL, "
        f"default {DEFAULT_SIGNAL}]",
    )
    s.add_argument("--container-image", default=env("MEGATRON_RLVR_CONTAINER"), help="[$MEGATRON_RLVR_CONTAINER]")
    s.add_argument(
        "--mount",
        action="append",
        default=None,
        metavar="SRC:DST",
        help="container mount (repeat) [$MEGATRON_RLVR_MOUNTS, comma-separated]",
    )
    s.add_argument(
        "--code",
        choices=("git", "image"),
        default=env("MEGATRON_RLVR_CODE", "git"),
        help="git: ship this repo's committed HEAD with the job; image: use the container's install",
    )
    s.add_argument(
        "--tunnel",
        choices=("local", "ssh"),
        default=env("MEGATRON_RLVR_TUNNEL", "local"),
        help="local: submit from this (login) node; ssh: submit through SSH",
    )
    s.add_argument("--ssh-host", default=env("MEGATRON_RLVR_SSH_HOST"), help="[$MEGATRON_RLVR_SSH_HOST]")
    s.add_argument("--ssh-user", default=env("MEGATRON_RLVR_SSH_USER", env("USER")), help="[$MEGATRON_RLVR_SSH_USER]")
    s.add_argument("--ssh-identity", default=env("MEGATRON_RLVR_SSH_IDENTITY"), help="private key file")
    s.add_argument(
        "--remote-job-dir",
        default=env("MEGATRON_RLVR_REMOTE_JOB_DIR"),
        help="ssh tunnel: job directory on the cluster's shared filesystem",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """Turn parsed arguments into checked options; raises LaunchError naming the option at fault."""
    mounts = args.mount
    if mounts is None:
        mounts = [m for m in os.environ.get("MEGATRON_RLVR_MOUNTS", "").split(",") if m.strip()]
    opts = LaunchOptions(
        executor=args.executor,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        job_name=args.name,
        dryrun=args.dryrun,
        detach=args.detach,
        env=parse_env(args.env),
        nemorun_home=args.nemorun_home,
        account=args.account,
        partition=args.partition,
        time=args.time,
        signal=None if str(args.signal).lower() in ("none", "") else args.signal,
        container_image=args.container_image,
        mounts=list(mounts),
        code=args.code,
        tunnel=args.tunnel,
        ssh_host=args.ssh_host,
        ssh_user=args.ssh_user,
        ssh_identity=args.ssh_identity,
        remote_job_dir=args.remote_job_dir,
        retries=args.retries,
    )
    check_options(opts)
    return opts


def parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchError(f"--env {item!r}: expected KEY=VALUE, e.g. --env NCCL_DEBUG=INFO")
        env[key.strip()] = value
    return env


def check_options(opts: LaunchOptions) -> None:
    if opts.executor not in EXECUTORS:
        raise LaunchError(f"--executor {opts.executor!r}: expected one of {', '.join(EXECUTORS)}")
    if opts.nodes < 1:
        raise LaunchError(f"--nodes: must be >= 1, got {opts.nodes}")
    if opts.nproc_per_node is not None and opts.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node: must be >= 1, got {opts.nproc_per_node}")
    if opts.retries < 0:
        raise LaunchError(f"--retries: must be >= 0, got {opts.retries}")
    if opts.executor == "local":
        if opts.nodes != 1:
            raise LaunchError(f"--nodes {opts.nodes}: the local executor runs on this machine only; use 1")
        return
    if opts.executor == "slurm_local":  # CPU nodes sharing this machine's filesystem: no account, no container
        if opts.signal is not None:
            opts.signal = check_signal(opts.signal, opts.time)
        return
    if opts.procs_per_node > H200_GPUS_PER_NODE:
        raise LaunchError(f"--nproc-per-node {opts.procs_per_node}: an H200 node has {H200_GPUS_PER_NODE} GPUs")
    if opts.dryrun:
        # a dry run only shows the script: missing site settings become visible placeholders
        for key, flag, placeholder in (
            ("account", "--account", "YOUR_ACCOUNT"),
            ("container_image", "--container-image", "YOUR_CONTAINER_IMAGE"),
        ):
            if not getattr(opts, key):
                setattr(opts, key, placeholder)
                print(f"[launch] dry run: {flag} not given, shown as {placeholder}", file=sys.stderr)
    if not opts.account:
        raise LaunchError("--account: the Slurm executor needs an account (or set $SBATCH_ACCOUNT)")
    if not opts.container_image:
        raise LaunchError(
            "--container-image: the Slurm executor runs in a pyxis container; give an image with megatron-core, "
            "vLLM and transformer-engine (or set $MEGATRON_RLVR_CONTAINER)"
        )
    if opts.signal is not None:
        opts.signal = check_signal(opts.signal, opts.time)
    for mount in opts.mounts:
        if ":" not in mount:
            raise LaunchError(f"--mount {mount!r}: expected SRC:DST (or SRC:DST:ro)")
    if opts.tunnel == "ssh":
        missing = [
            flag
            for flag, value in (
                ("--ssh-host", opts.ssh_host),
                ("--ssh-user", opts.ssh_user),
                ("--remote-job-dir", opts.remote_job_dir),
            )
            if not value
        ]
        if missing:
            raise LaunchError(f"{', '.join(missing)}: needed with --tunnel ssh")


def time_limit_seconds(value: str) -> int | None:
    """Slurm's --time in seconds (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None when it is unlimited."""
    if value.strip().lower() in ("infinite", "unlimited", "-1", "0"):
        return None
    days, _, rest = value.strip().rpartition("-")
    parts = [int(p) for p in rest.split(":")] if re.fullmatch(r"\d+(:\d+){0,2}", rest) else None
    if parts is None or (days and not days.isdigit()):
        raise LaunchError(f"--time {value!r}: expected a Slurm time limit such as 04:00:00 or 1-12:00:00")
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def check_signal(value: str, time_limit: str) -> str:
    """The --signal value as sbatch takes it (USR1@300), checked against what training handles and the limit."""
    if value.upper().startswith(("B:", "R:")):
        raise LaunchError(
            f"--signal {value!r}: give SIG@SECONDS without 'B:' or 'R:': with 'B:' Slurm signals only the batch "
            "shell, which waits on srun and would not pass it on (the job would end without its checkpoint)"
        )
    match = _SIGNAL_RE.fullmatch(value.upper())
    if not match or match.group(1) not in _STOP_SIGNALS:
        raise LaunchError(
            f"--signal {value!r}: expected SIG@SECONDS with SIG one of {', '.join(_STOP_SIGNALS)} "
            f"(what training handles), e.g. {DEFAULT_SIGNAL}; or 'none'"
        )
    name, seconds = match.group(1), int(match.group(2))
    limit = time_limit_seconds(time_limit)
    if not 0 < seconds <= 65535:  # sbatch's range
        raise LaunchError(f"--signal {value!r}: the lead time must be 1..65535 seconds")
    if limit is not None and seconds >= limit:
        raise LaunchError(
            f"--signal {value!r}: {seconds} s before the end of a {time_limit} job is at or before "
            "its start; give fewer seconds or a longer --time"
        )
    return f"{name}@{seconds}"


def signal_env(signal: str) -> dict[str, str]:
    """What torchrun needs to pass the warning on: handle it (forward to the ranks, rather than die of it) and
    give the ranks the whole lead time to finish the step and write the checkpoint before it kills them."""
    name, seconds = signal.split("@")
    handled = _TORCHRUN_SIGNALS + (() if f"SIG{name}" in _TORCHRUN_SIGNALS else (f"SIG{name}",))
    return {"PET_SIGNALS_TO_HANDLE": ",".join(handled), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": seconds}


# ---------------------------------------------------------------------------------------------------------------
# Executors


def _import_nemo_run(opts: LaunchOptions) -> Any:
    if opts.nemorun_home:
        os.environ["NEMORUN_HOME"] = str(Path(opts.nemorun_home).expanduser().resolve())
    import nemo_run

    return nemo_run


def local_executor(opts: LaunchOptions, run: Any, launcher: str | None = "torchrun") -> Any:
    """torchrun on this machine, `procs_per_node` processes (gloo on CPU, NCCL on GPUs); or one plain process."""
    # nemo-run starts `torchrun` from PATH: make it this interpreter's, so ranks import this environment.
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    env = {"PYTHONUNBUFFERED": "1", **opts.env}
    return run.LocalExecutor(ntasks_per_node=opts.procs_per_node, launcher=launcher, env_vars=env)


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
    written under NEMORUN_HOME. With `opts.dryrun` the job script is printed instead of run. `launcher=None`
    starts the module as plain processes (single-process tools such as convert).
    """
    run = _import_nemo_run(opts)
    # the git packager archives the repository of the current directory, and local ranks start here too
    os.chdir(REPO_ROOT)
    ship = dict(ship or {})
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
    task = run.Script(path=module, m=True, entrypoint="python", args=args)
    detach = opts.detach and opts.executor != "local"
    with run.Experiment(opts.job_name or name, executor=executor, log_level="WARN") as exp:
        exp.add(task, executor=executor, name=name)
        if opts.dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            print(dryrun_script(exp, opts, module, launcher))
            return 0
        exp.run(detach=detach, tail_logs=not detach)
    # leaving the `with` block is where nemo-run waits for the tasks and records their final state
    return exit_status(exp, detached=detach)


def dryrun_script(exp: Any, opts: LaunchOptions, module: str = CLI_MODULE, launcher: str | None = "torchrun") -> str:
    """The job script a dry run produced: nemo-run's sbatch file for Slurm, the torchrun line locally."""
    job = exp.jobs[0]
    if opts.executor in SLURM_EXECUTORS:
        path = Path(job.executor.experiment_dir) / f"{job.executor.job_name}_sbatch.sh"
        if not path.is_file():
            raise LaunchError(f"dry run: nemo-run wrote no sbatch script at {path}")
        return f"# sbatch script: {path}\n{path.read_text()}"
    args = shlex.join(job.task.args)
    if launcher is None:
        return f"# local executor: one process\npython -m {module} {args}"
    return (
        f"# local executor: {opts.procs_per_node} processes\n"
        f"torchrun --nnodes 1 --nproc-per-node {opts.procs_per_node} -m {module} {args}"
    )


_SUCCESS = "SUCCEEDED"
_SUBMITTED_OK = ("SUBMITTED", "PENDING", "RUNNING", "SUCCEEDED")


def exit_status(exp: Any, detached: bool = False) -> int:
    """0 when every task succeeded (or, detached, was accepted by Slurm); 1 otherwise, naming the failed task."""
    failed = []
    for job in exp.jobs:
        state = job.state.name if hasattr(job.state, "name") else str(job.state)
        ok = state in _SUBMITTED_OK if detached else state == _SUCCESS
        if not ok:
            failed.append(f"{job.id}: {state}")
    if failed:
        logs = exp.jobs[0].executor.job_dir if exp.jobs else "?"
        print(f"[launch] task failed: {'; '.join(failed)} (logs: {logs})", file=sys.stderr)
        return 1
    return 0
