"""Which verifier scores a row, and the table of verifiers one process holds (the reward pool's workers each hold one).

`VerifierTable.route(task, reference)` names the verifier of one row, checking its reference (a ValueError naming
the task or the key when it cannot be scored); that name is also the metric the pool counts rows under
(``verifier/<name>``). The names and the rule, first match wins:

- ``extra:<task>``: a scorer handed to the pool in code (``extra_scorers``);
- ``plugin:<task>``: a task of ``reward.plugins`` (`plugins.py`);
- ``reasoning_gym:<NAME>``: a ``reasoning_gym:NAME`` task, scored by that dataset's ``score_answer`` on the answer
  ``reward.answer`` reads (`answers.py`);
- ``synlogic:<data_source>``: a ``logic`` row whose reference names a ``data_source`` that the checkout at
  ``reward.synlogic_dir`` has an official verifier for (`synlogic.py`);
- ``logic``: any other logic row, by the generic matcher (`logic.py`), only while ``reward.logic_fallback`` is true
  (false: the row is an error naming its data_source); a reference dict's non-string answer is compared as JSON;
- ``math``, ``code``, ``countdown``: the built-in verifiers (`scoring.py`).

``logic`` and ``countdown`` are cheap and bounded and are scored in the caller's process; every other verifier runs
in the pool's workers. `warm` does a verifier's slow one-time setup (importing reasoning-gym, building a dataset's
scorer) before any item's deadline starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from megatron_rlvr.rewards import plugins, reasoning_gym
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.scoring import TASKS, check_reference, score

IN_PROCESS = frozenset({"logic", "countdown"})


def reserved_task(task: str) -> str | None:
    """Why a plugin may not take the task name ``task`` (a built-in or reasoning-gym name), or None."""
    if task in TASKS:
        return f"{task!r} is a built-in verifier's task; give the plugin's rows a task name of their own"
    if reasoning_gym.dataset_name(task) is not None:
        return f"{task!r}: the {reasoning_gym.TASK_PREFIX} prefix names reasoning-gym's own verifiers"
    return None


def check_config(cfg: RewardConfig) -> None:
    """Import what ``cfg`` names (plugins, the SynLogic checkout) once; ConfigError naming the key if unusable.
    `megatron_rlvr.config.load_config` calls it, so that a bad spec stops a run before anything starts."""
    plugins.check_plugins(cfg.plugins, reserved_task)
    if cfg.synlogic_dir:
        from megatron_rlvr.rewards.synlogic import SynLogicVerifiers

        SynLogicVerifiers.load(cfg.synlogic_dir)


class VerifierTable:
    """The verifiers of one process under ``cfg`` (plugins and the SynLogic checkout imported on construction)."""

    def __init__(self, cfg: RewardConfig, extra_scorers: Mapping[str, Callable] | None = None):
        self.cfg = cfg
        self.extra = dict(extra_scorers or {})
        self.plugins = {task: plugins.load_plugin(task, spec) for task, spec in cfg.plugins.items()}
        self.synlogic = None
        if cfg.synlogic_dir:
            from megatron_rlvr.rewards.synlogic import SynLogicVerifiers

            self.synlogic = SynLogicVerifiers.load(cfg.synlogic_dir)

    def route(self, task: str, reference: Any) -> str:
        """The verifier of one row (see the module docstring); ValueError naming what is wrong with the row."""
        if task in self.extra:
            return f"extra:{task}"
        if task in self.plugins:
            return f"plugin:{task}"
        if reasoning_gym.dataset_name(task) is not None:
            reasoning_gym.check_reference(task, reference)
            return task
        if task == "logic":
            return self._route_logic(reference)
        if task not in TASKS:
            names = list(TASKS) + sorted(self.plugins) + [f"{reasoning_gym.TASK_PREFIX}NAME"]
            raise ValueError(f"reward task {task!r}: unknown; expected one of {names} (reward.plugins adds tasks)")
        check_reference(task, reference)
        return task

    def _route_logic(self, reference: Any) -> str:
        source = reference.get("data_source") if isinstance(reference, Mapping) else None
        if self.synlogic is not None and source in self.synlogic.tasks:
            return f"synlogic:{source}"
        if not self.cfg.logic_fallback:
            where = (
                f"reward.synlogic_dir={self.cfg.synlogic_dir!r}" if self.cfg.synlogic_dir else "no reward.synlogic_dir"
            )
            raise ValueError(
                f"logic row with data_source {source!r}: no official SynLogic verifier ({where}) and "
                f"reward.logic_fallback=false; set reward.logic_fallback=true for the generic matcher"
            )
        check_reference("logic", _logic_gold(reference))
        return "logic"

    def in_process(self, verifier: str) -> bool:
        return verifier in IN_PROCESS

    def warm(self, verifier: str) -> None:
        name = reasoning_gym.dataset_name(verifier)
        if name is not None:
            reasoning_gym.scorer(name)

    def score_row(self, task: str, response: str, reference: Any) -> float:
        """One row's reward in this process: `route`, then `score`."""
        return self.score(self.route(task, reference), task, response, reference)

    def score(self, verifier: str, task: str, response: str, reference: Any) -> float:
        """The reward of one response by the verifier ``route`` named."""
        kind, _, name = verifier.partition(":")
        if kind == "extra":
            return float(self.extra[name](response, reference))
        if kind == "plugin":
            return plugins.plugin_reward(name, self.plugins[name], response, reference)
        if kind == "synlogic":
            return self.synlogic.verify(name, response, reference)
        if reasoning_gym.dataset_name(verifier) is not None:
            return reasoning_gym.score(verifier, response, reference, self.cfg.answer)
        if kind == "logic":
            return score("logic", response, _logic_gold(reference), self.cfg)
        return score(task, response, reference, self.cfg)


def _logic_gold(reference: Any) -> Any:
    """The gold string of a logic reference: the string itself, or a SynLogic dict's answer (JSON if not a str)."""
    if not isinstance(reference, Mapping):
        return reference
    answer = reference.get("answer")
    return answer if isinstance(answer, str) or answer is None else json.dumps(answer, ensure_ascii=False)
