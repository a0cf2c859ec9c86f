"""Write one of the check's random Qwen2 checkpoints (common.MODELS) ahead of the stage that needs it: gpu_check.sh
runs it in the background while the extension builds, so the ~2 GB of the 1B model cost no time of their own.

    python tools/gpu_check/make_model.py --model 1b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(common.MODELS), required=True)
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK)
    return p


def preflight(args: argparse.Namespace) -> list[str]:
    from megatron_rlvr.testing.tiny_models import write_random_hf_checkpoint  # noqa: F401

    return []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    timer = common.Timer(cuda=False)
    with timer:
        out = common.model_dir(args.model, args.work)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"make_model: {out} ({common.param_count(common.MODELS[args.model]) / 1e9:.3f}B parameters, "
        f"{size / 2**30:.2f} GiB) in {timer.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
