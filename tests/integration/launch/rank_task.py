"""A tiny real distributed task for the launcher tests, started by torchrun through nemo-run.

    python -m tests.integration.launch.rank_task OUT_FILE ok|fail

Every rank joins a gloo group and all-reduces its rank + 1; rank 0 writes `world=<W> sum=<S>` to OUT_FILE.
With `fail`, the last rank exits with status 3 after the all-reduce (so the launcher must report a failure).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(argv: list[str]) -> int:
    out_file, mode = argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    if mode == "fail" and rank == world - 1:
        return 3
    if rank == 0:
        Path(out_file).write_text(f"world={world} sum={int(total.item())}\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
