"""Verifiable rewards: `score(task, response, reference)` and the parallel `RewardPool` the trainer scores with.

Built-in tasks: math (math-verify), code (sandboxed), logic (SynLogic/BBH matching) and countdown (the demo task);
verifiers users bring: plugins from the config (`plugins.py`), SynLogic's official verifiers (`synlogic.py`) and
reasoning-gym's scorers (`reasoning_gym.py`). `verifiers.py` decides which verifier scores a row (docs/rewards.md).
"""

from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.pool import RewardPool
from megatron_rlvr.rewards.scoring import TASKS, check_reference, score

__all__ = ["RewardConfig", "RewardPool", "TASKS", "check_reference", "score"]
