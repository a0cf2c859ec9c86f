"""What a model is asked: the benchmarks' problems (local files in each public release's layout -> `Problem`s) and
the one encoding of a prompt into the token ids an engine continues.

Training data (data/), in-training validation (experience/) and evaluation (eval/) all read these, so a problem is
posed to a model the same way wherever it is asked. The modules import nothing heavier than the standard library.
"""

from megatron_rlvr.problems.benchmarks import BENCHMARKS, Problem, benchmark_files, load_benchmark

__all__ = ["BENCHMARKS", "Problem", "benchmark_files", "load_benchmark"]
