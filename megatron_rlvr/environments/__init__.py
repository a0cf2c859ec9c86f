"""Multi-turn rollouts (docs/multi-turn.md): the `Environment` protocol a trajectory's counterpart implements, the
episode runner that plays trajectories token in, token out on a rollout engine, the worker processes that contain
the environments, and the built-in Python tool.

Importing this package imports neither vLLM nor transformers.
"""

from megatron_rlvr.environments.base import Environment, EpisodeEngine, Message, Problem, Step
from megatron_rlvr.environments.config import EnvironmentConfig

__all__ = ["Environment", "EnvironmentConfig", "EpisodeEngine", "Message", "Problem", "Step"]
