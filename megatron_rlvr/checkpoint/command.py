"""`megatron-rlvr ckpt verify DIR`: check one checkpoint, or every checkpoint under a checkpoints root, against its
manifest, and say which one ``checkpoint.resume: latest`` would pick."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_rlvr.checkpoint.manifest import MANIFEST, verify
from megatron_rlvr.checkpoint.store import latest_candidates, step_dirs, step_of


def main(argv: list[str] | None = None) -> int:
    """`megatron-rlvr ckpt verify DIR`: check one checkpoint, or every checkpoint under a checkpoints root."""
    parser = argparse.ArgumentParser(prog="megatron-rlvr ckpt", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("verify", help="check checkpoints against their manifests (exit 1 if any is damaged)")
    p.add_argument("dir", type=Path, help="a step directory (step-000012) or the checkpoints root holding them")
    args = parser.parse_args(argv)
    target: Path = args.dir
    single = (target / MANIFEST).is_file() or (target / "trainer_state.json").is_file() or step_of(target) is not None
    checkpoints = [target] if single else step_dirs(target)
    if not checkpoints:
        print(
            f"error: {target}: neither a checkpoint (no {MANIFEST} or trainer_state.json) nor a checkpoints root "
            "(no step-NNNNNN directories)",
            file=sys.stderr,
        )
        return 2
    reports = {path: verify(path) for path in checkpoints}
    for report in reports.values():
        print(report.summary(), flush=True)
    if not single:  # what `checkpoint.resume: latest` would pick, in its order (a missing `latest` target included)
        for path in latest_candidates(target):
            report = reports.get(path) or verify(path)
            if path not in reports:
                print(report.summary(), flush=True)
                reports[path] = report
            if report.ok:
                print(f"checkpoint.resume=latest would resume from {path.name}")
                break
        else:
            print("checkpoint.resume=latest would find no usable checkpoint")
    return 0 if all(r.ok for r in reports.values()) else 1
