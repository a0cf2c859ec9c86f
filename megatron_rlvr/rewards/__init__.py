"""Verifiable rewards: `score(task, response, reference)` and the parallel `RewardPool` the trainer scores with.

Tasks: math (math-verify), code (sandboxed), logic (SynLogic/BBH matching) and countdown (the demo task).
"""

from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.pool import RewardPool
from megatron_rlvr.rewards.scoring import TASKS, check_reference, score

__all__ = ["RewardConfig", "RewardPool", "TASKS", "check_reference", "score"]
