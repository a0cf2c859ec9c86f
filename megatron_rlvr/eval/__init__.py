"""Evaluation: the unbiased pass@k estimator, the large-K sampling runner, tables and plots. The benchmarks' problems
it samples are read by `megatron_rlvr.problems`.

Only the estimator is imported here (cheap); the runner lives in `runner`, the library's entry points (`evaluate`,
`estimate`) in `api` and the command line over them in `command`.
"""

from megatron_rlvr.eval.passk import pass_at_k

__all__ = ["pass_at_k"]
