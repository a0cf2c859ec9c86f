"""A torchrun task for the entry-point tests: `python -m tests.integration.user_error_rank one|every` fails with a user error on
rank 1 only (rank 0 waits until torchrun stops it), or on every rank (rank 1 first)."""

import os
import sys
import time

from megatron_rlvr.errors import UserError
from megatron_rlvr.runtime.console import report_user_error

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if sys.argv[1] == "every" or rank == 1:
        if sys.argv[1] == "every" and rank == 0:
            time.sleep(1)  # rank 1 meets it first, most of the time; either rank may say it
        sys.exit(report_user_error(UserError(f"data.path: dataset file x.jsonl: not found (met on rank {rank})")))
    time.sleep(120)  # torchrun stops this rank when rank 1 fails
