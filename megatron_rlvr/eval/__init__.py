"""Evaluation: the unbiased pass@k estimator, the large-K sampling runner, tables and plots. The benchmarks' problems
it samples are read by `megatron_rlvr.problems`.

Only the estimator is imported here (cheap); the runner and the CLI live in `runner` and `command`.
"""

from megatron_rlvr.eval.passk import pass_at_k

__all__ = ["pass_at_k"]
