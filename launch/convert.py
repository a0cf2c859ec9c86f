"""Launch a checkpoint conversion (HF <-> megatron dist checkpoint) through nemo-run.

Everything after `--` goes verbatim to `megatron-rlvr convert`, run as one plain process (no torchrun) on one node,
e.g. on a cluster (paths as the container sees them):

    python launch/convert.py --executor slurm_h200 -- hf-to-mcore --hf-dir /models/Qwen2.5-32B --out /models/...
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `launch` is a folder of the repo, not installed

from launch.executors import run_task  # noqa: E402
from launch.options import LaunchError, add_launch_arguments, options_from_args  # noqa: E402
from megatron_rlvr.errors import UserError  # noqa: E402


def check_local_input(convert_args: list[str]) -> None:
    """A conversion by the local executors reads this machine's files, from the repository root (where the job
    starts): its input is there, or a UserError names it and what writes one."""
    from launch.executors import REPO_ROOT
    from megatron_rlvr.runtime.console import quiet_import_warnings

    quiet_import_warnings()  # megatron-core's import-time notes, as every megatron-rlvr command keeps them off
    from megatron_rlvr.bridge.convert import build_parser
    from megatron_rlvr.models.hf_config import read_hf_config

    args = build_parser().parse_args(convert_args)
    os.chdir(REPO_ROOT)
    if args.direction == "hf-to-mcore":
        read_hf_config(args.hf_dir)
    elif args.direction == "mcore-to-hf" and not (args.mcore_dir / "metadata.json").is_file():
        raise LaunchError(
            f"--mcore-dir {args.mcore_dir}: not a megatron dist checkpoint (no metadata.json under {REPO_ROOT} or "
            "as an absolute path); a training run's are <trainer.output_dir>/checkpoints/step-N, and "
            "`megatron-rlvr convert hf-to-mcore` writes one"
        )
    elif args.direction == "gguf-to-hf" and not args.gguf_file.is_file():
        raise LaunchError(f"GGUF file {args.gguf_file}: not found (docs/real-model.md says where one comes from)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch/convert.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_launch_arguments(parser)
    parser.add_argument("convert_args", nargs=argparse.REMAINDER, help="-- then the `megatron-rlvr convert` arguments")
    args = parser.parse_args(argv)
    convert_args = args.convert_args[1:] if args.convert_args[:1] == ["--"] else args.convert_args
    if not convert_args:
        print("error: nothing to convert: give `-- hf-to-mcore ...` or `-- mcore-to-hf ...`", file=sys.stderr)
        return 2
    try:
        if args.nodes != 1 or args.nproc_per_node not in (None, 1):
            raise LaunchError("--nodes/--nproc-per-node: megatron-rlvr convert runs as one process on one node")
        args.nproc_per_node = 1
        opts = options_from_args(args)
        if opts.executor != "slurm_h200":  # its paths are the container's
            try:
                check_local_input(convert_args)
            except UserError as e:
                if not opts.dryrun:
                    raise
                print(f"[launch] dry run: warning: the job would stop at once: {e}", file=sys.stderr)
    except UserError as e:  # LaunchError, a missing model directory
        print(f"error: {e}", file=sys.stderr)
        return 2
    # no torchrun: the converter makes its own world of one process (under torchrun it would wait for the agent)
    name = f"convert_{convert_args[0]}".replace("-", "_")
    return run_task(name, ["convert", *convert_args], opts, launcher=None)


if __name__ == "__main__":
    sys.exit(main())
