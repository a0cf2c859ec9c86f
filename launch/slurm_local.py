"""The CPU Slurm executor (`--executor slurm_local`): the Slurm H200 path without GPUs or containers, for a cluster
whose nodes share this machine's filesystem (`tools/env/slurm_cluster.sh` runs one on this machine; docs/slurm-local.md).

Same nemo-run template as `slurm_h200`: sbatch -> srun one task per node -> torchrun per node with c10d rendezvous ->
`python -m megatron_rlvr.cli ...`. What differs, and why:
- code: the job's `code/` directory is a link to this working tree (the nodes see it; no archive of HEAD, so the
  built extension and uncommitted changes run as they are);
- shipped files (the resolved run config) are written under NEMORUN_HOME, which the nodes share, like the local
  executor does;
- the rendezvous port is one found free at submission (nemo-run's fixed 29500 collides with other torchrun jobs),
  outside the ephemeral range: the requeued rerun reuses it (megatron_rlvr/runtime/ports.py);
- ranks get OMP_NUM_THREADS=1 (nodes on one machine share its cores).

`stop_requeue_lines` is shared with the H200 executor: the batch-shell lines that make a training job stopped by its
warning signal requeue itself (see there; the real cluster's tests run them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from megatron_rlvr.runtime.ports import lasting_free_port

LOCAL_ENV = {
    "PYTHONUNBUFFERED": "1",
    # several "nodes" share this machine's cores: one thread per rank, as the tests and the demo use
    "OMP_NUM_THREADS": "1",
}
# Where a stopping training run leaves its marker (rank 0, megatron_rlvr/runtime/preemption.py): in the job directory, which
# every node and the batch shell see.
STOP_MARKER_ENV = "MEGATRON_RLVR_STOP_MARKER"


def stop_requeue_lines(ranks_job_dir: str | None = None) -> str:
    """Batch-shell lines (nemo-run's `setup_lines`, before the srun) for a training job with a warning signal.

    What the real cluster showed: a run that stopped cleanly on `--signal=USR1@N` ends with torchrun's exit status 1
    (it re-raises the signal it forwarded), so the job ended FAILED and was requeued only while nemo-run's retries
    lasted, each stop spending one. Now rank 0 writes a marker into the job directory when the ranks agree to stop;
    on exit the batch shell requeues the job itself when the marker is there (unless nemo-run's own retry just did)
    and exits 0, so the job reads REQUEUED, then COMPLETED when the rerun has resumed and finished.
    `scancel --signal=USR1 --full` also signals this shell, whose default action for USR1 would end the job under
    the ranks' checkpoint: it is trapped. The job directory is the one of the batch output file (nemo-run writes it
    there); `ranks_job_dir` is where the ranks see it (a container's mount, `/nemo_run`), None: the same path.
    """
    marker = "stop_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}"
    ranks_dir = ranks_job_dir or "$megatron_rlvr_job_dir"
    return "\n".join(
        [
            "# megatron-rlvr: a run stopped by its warning signal requeues the job; the rerun resumes from its checkpoint",
            'megatron_rlvr_job_dir=$(dirname "$(scontrol show job -o "$SLURM_JOB_ID" | tr " " "\\n" | sed -n "s/^StdOut=//p")")',
            f'megatron_rlvr_stop="$megatron_rlvr_job_dir/{marker}"',
            f'export {STOP_MARKER_ENV}="{ranks_dir}/{marker}"',
            "trap 'echo \"[launch] batch shell: got SIGUSR1; the ranks finish their step and checkpoint\"' USR1",
            "megatron_rlvr_requeue_on_stop() {",
            "  local status=$?",
            '  if [ -f "$megatron_rlvr_stop" ]; then',
            '    echo "[launch] the run stopped on $(cat "$megatron_rlvr_stop") after its checkpoint: requeue"',
            '    if ! { [ "$status" -ne 0 ] && [ "$TORCHX_MAX_RETRIES" -gt "${SLURM_RESTART_COUNT:-0}" ]; }; then',
            '      scontrol requeue "$SLURM_JOB_ID"',
            "    fi",
            "    exit 0",
            "  fi",
            "}",
            "trap megatron_rlvr_requeue_on_stop EXIT",
        ]
    )


def slurm_local_executor(
    opts: Any,
    run: Any,
    repo_root: Path,
    launcher: str | None = "torchrun",
    preemptible: bool = False,
    signal_env: dict[str, str] | None = None,
) -> Any:
    """`opts.nodes` nodes of the local cluster, one torchrun per node starting `opts.procs_per_node` ranks (gloo)."""
    from nemo_run.config import get_nemorun_home

    from launch.shipping import RepoLinkPackager

    # srun starts `torchrun` from PATH, and the batch script exports the submitter's environment: put this
    # interpreter's bin first, so the ranks import this environment
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    home = Path(get_nemorun_home())
    warn = preemptible and opts.signal is not None
    nemo_launcher: Any = launcher
    if launcher == "torchrun":
        nemo_launcher = run.Torchrun(rdzv_port=lasting_free_port())
    return run.SlurmExecutor(
        account=opts.account or "",
        partition=opts.partition,
        time=opts.time,
        nodes=opts.nodes,
        ntasks_per_node=1 if launcher == "torchrun" else opts.procs_per_node,
        torchrun_nproc_per_node=opts.procs_per_node if launcher == "torchrun" else None,
        signal=opts.signal if warn else None,
        env_vars={**LOCAL_ENV, **(signal_env or {}), **opts.env},
        setup_lines=stop_requeue_lines() if warn else None,
        retries=opts.retries,
        # LocalTunnel copies nothing: the job directory must be where nemo-run keeps its experiments
        tunnel=run.LocalTunnel(job_dir=str(home / "experiments")),
        packager=RepoLinkPackager(repo=str(repo_root)),
        launcher=nemo_launcher,
        job_name_prefix="megatron-rlvr-",
    )
