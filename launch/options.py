"""Launch options: what the launch scripts accept on the command line (with environment-variable defaults, so a
cluster profile can live in a shell rc), checked into one `LaunchOptions` before any executor is built.

Every bad option is a `LaunchError` naming the flag and what was expected; the Slurm warning signal (`--signal`) is
checked against what training handles and against the job's time limit here too.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_rlvr.errors import UserError

EXECUTORS = ("local", "slurm_h200", "slurm_local")
SLURM_EXECUTORS = ("slurm_h200", "slurm_local")
H200_GPUS_PER_NODE = 8
# Training stops cleanly on this signal (megatron_rlvr/runtime/preemption.py): Slurm sends it to every process of the job
# step this many seconds before the time limit; the run finishes its step, writes a checkpoint and exits.
DEFAULT_SIGNAL = "USR1@300"
# torchrun's own list (its default) plus the warning signal: it forwards them to the ranks instead of dying of one.
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_SIGNAL_RE = re.compile(r"(?:SIG)?([A-Z0-9]+)@(\d+)")
_STOP_SIGNALS = ("USR1", "TERM")  # the ones megatron_rlvr.runtime.preemption handles


class LaunchError(UserError, ValueError):
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
    g.add_argument(
        "--dryrun",
        action="store_true",
        help="print the job script (sbatch for Slurm) and exit; it writes nothing unless a nemo-run home is given "
        "(--nemorun-home, $NEMORUN_HOME): then the job directory a submission would write, under it",
    )
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
