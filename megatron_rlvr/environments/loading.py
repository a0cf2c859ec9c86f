"""Which environment ``environment.name`` names: the built-in ``python_tool``, or a user's factory from a module path
or a file (``package.module:factory`` / ``FILE.py:factory``, imported like reward plugins: `rewards.plugins`).

A factory is a callable of no arguments that returns a fresh `Environment`; a class is one. Bad specs are one-line
`ConfigError`s naming ``environment.name``; `check_environment` imports the spec when the config loads, and each worker
process (`host.py`) loads the spec again for itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from megatron_rlvr.environments.base import Environment
from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.plugins import import_spec

BUILT_IN = ("python_tool",)


def environment_factory(cfg: EnvironmentConfig, reward: RewardConfig | None = None) -> Callable[[], Environment]:
    """A callable making one fresh environment per trajectory; the built-in tool scores answers with the verifiers
    of ``reward`` (the run's reward section; its defaults when None)."""
    if cfg.name == "python_tool":
        from megatron_rlvr.environments.python_tool import PythonToolEnvironment, tool_limits
        from megatron_rlvr.rewards.verifiers import VerifierTable

        reward = reward or RewardConfig()
        return partial(
            PythonToolEnvironment, tool_limits(cfg, reward.sandbox_accept_rlimits_only), VerifierTable(reward)
        )
    if ":" not in cfg.name:
        raise ConfigError(
            f"environment.name: expected one of {list(BUILT_IN)}, 'package.module:factory' or 'FILE.py:factory', "
            f"got {cfg.name!r}"
        )
    factory, _ = import_spec("environment.name", cfg.name, what="factory")
    if not callable(factory):
        raise ConfigError(f"environment.name: {cfg.name} is a {type(factory).__name__}, not a callable factory")
    return factory


def check_environment(cfg: EnvironmentConfig) -> None:
    """Import the configured environment's factory, so that a bad spec fails when the config loads. Nothing is
    made here: an environment whose construction hangs is the workers' to kill (`host.py`)."""
    if cfg.enabled and cfg.name not in BUILT_IN:
        environment_factory(cfg)
