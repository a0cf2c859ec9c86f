"""Before the actor and bridge stages: can the library's process group run every collective they use?

``megatron_rlvr.runtime.distributed.init_process_group`` starts NCCL when CUDA is there, and NCCL runs only CUDA tensors;
the actor and the bridge also all-reduce small CPU flags (``MegatronActor._all_finite``, the export's
``raise_everywhere``). This probe all-reduces a CPU and a CUDA tensor on the library's group, then on
``cuda:nccl,cpu:gloo``, and writes which works. gpu_check.sh runs the later stages with the library's backend when
it can, else with the fallback, and says so in the summary.

    python tools/gpu_check/pg_probe.py --out /tmp/pg.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

FALLBACK = "cuda:nccl,cpu:gloo"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    import torch.distributed  # noqa: F401

    from megatron_rlvr.runtime import distributed  # noqa: F401

    return []


def _collectives(devices: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for device in devices:
        try:
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            out[device] = "ok" if float(t) == dist.get_world_size() else f"wrong sum {float(t)}"
        except Exception as exc:  # the point of the probe: record which collective the backend refuses
            out[device] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    from megatron_rlvr.runtime import distributed

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    distributed.init_process_group()
    result: dict[str, Any] = {"library_backend": str(dist.get_backend()), "library": _collectives(devices)}
    dist.destroy_process_group()
    if all(v == "ok" for v in result["library"].values()):
        result["use_backend"] = None
    else:
        import os

        os.environ["MASTER_PORT"] = str(distributed.free_port())
        dist.init_process_group(backend=FALLBACK)
        result["fallback_backend"] = FALLBACK
        result["fallback"] = _collectives(devices)
        dist.destroy_process_group()
        result["use_backend"] = FALLBACK if all(v == "ok" for v in result["fallback"].values()) else None
    common.write_json(args.out, result)
    print(
        f"pg_probe: library backend {result['library_backend']}: {result['library']}; "
        f"later stages use {result['use_backend'] or 'the library backend'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
