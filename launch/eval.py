"""Launch large-K evaluation (pass@k, up to K = 1024 samples per problem) of a recipe through nemo-run.

python launch/eval.py --recipe eval_k1024_qwen2.5-math-7b --executor slurm_h200 --nodes 2 model.load=/results/...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `launch` is a folder of the repo, not installed

from launch.recipes import recipe_job_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(recipe_job_main("eval", sys.argv[1:], __doc__))
