"""`megatron-rlvr estimate RECIPE`: an eval recipe's cost before anything is sampled (samples, tokens, and with
recorded or given throughput the wall time and GPU-hours) and the widest 95% interval its problem counts allow.

The arithmetic is eval/estimate.py's (`recipe_estimate`, `format_estimate`); this module only reads the recipe
through config.py, which eval/ cannot import (config composes eval's section), and prints.

    megatron-rlvr estimate configs/eval_k1024_qwen2.5-math-7b.yaml [key=value ...] [--recorded RUN_DIR]
"""

from __future__ import annotations

import argparse
import json

from megatron_rlvr.config import load_config
from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.estimate import format_estimate, recipe_estimate


def main(argv: list[str] | None = None) -> int:
    from megatron_rlvr.runtime.console import report_user_error

    parser = argparse.ArgumentParser(
        prog="megatron-rlvr estimate", description="an eval recipe's cost and interval bound, before sampling"
    )
    parser.add_argument("recipe", help="an eval recipe (configs/eval_*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. eval.n_samples=256")
    parser.add_argument("--recorded", help="a run directory of the same model and settings (its timing.jsonl)")
    parser.add_argument("--tokens-per-second", type=float, help="the engine's throughput on the job's GPUs, if known")
    parser.add_argument("--gpus", type=int, help="GPUs of the job (default: rollout.tp; 0 for eval.dtype float32: CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    try:
        job = recipe_estimate(
            load_config(args.recipe, args.overrides), args.recorded, args.tokens_per_second, args.gpus
        )
    except (UserError, OSError) as exc:
        return report_user_error(exc)
    print(json.dumps(job.to_json()) if args.json else format_estimate(job), end="" if not args.json else "\n")
    return 0
