"""Launch RLVR training of a recipe through nemo-run (local torchrun, or Slurm H200 nodes).

    python launch/train.py --recipe qwen2.5-32b_math-l3to5_casp --executor slurm_h200 --nodes 4 [--dryrun] \
        [--force] [key=value ...]

Before a Slurm job is queued, `megatron-rlvr plan` checks that the layout fits the H200s' memory; a layout that
cannot fit is refused with exit status 3 and the component that breaks it (--force queues it anyway).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `launch` is a folder of the repo, not installed

from launch.recipes import recipe_job_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(recipe_job_main("train", sys.argv[1:], __doc__))
