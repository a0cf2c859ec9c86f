"""reasoning-gym's tasks scored by their own ``score_answer`` (PyPI ``reasoning-gym``, an optional extra).

A row's task is ``reasoning_gym:NAME`` (NAME a registered reasoning-gym dataset, e.g. ``countdown``); its reference
is the dataset entry less its question: ``{"answer": <gold or null>, "metadata": {...}}`` (what
``data prepare reasoning-gym`` writes). The response's answer is read under ``reward.answer`` (`answers.py`): by
default (``tagged``) the content of its last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``, the
format its prompts ask for), else the whole response, stripped; ``last_number`` and ``boxed`` read chat answers that
carry no tags. The reward is ``score_answer(answer, entry)`` of the dataset with its default config, exactly as
returned: some datasets give
partial credit for a wrong answer in the right form (countdown: 0.05 for a wrong expression over the right
numbers, 0.01 for one that does not parse), and a row counts as correct (pass@k, PBA) only at 1.0.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.rewards.answers import read_answer

TASK_PREFIX = "reasoning_gym:"
INSTALL_HINT = "pip install 'megatron-rlvr[tasks]' (or pip install reasoning-gym==0.1.25)"


class ReasoningGymMissingError(UserError, ImportError):
    """reasoning-gym is not installed; the message says how to install it."""


def dataset_name(task: str) -> str | None:
    """NAME of a ``reasoning_gym:NAME`` task, else None."""
    return task[len(TASK_PREFIX) :] if task.startswith(TASK_PREFIX) else None


def require_reasoning_gym(why: str = "") -> None:
    """ReasoningGymMissingError (one line, how to install) unless the package can be imported; cheap: no import
    (routing checks every row; once the first score imported the package, find_spec reads sys.modules)."""
    if importlib.util.find_spec("reasoning_gym") is None:
        where = f" ({why})" if why else ""
        raise ReasoningGymMissingError(f"reasoning-gym is not installed{where}; {INSTALL_HINT}")


def check_reference(task: str, reference: Any) -> None:
    require_reasoning_gym(f"task {task!r}")
    if not dataset_name(task):
        raise ValueError(f"reward task {task!r}: expected reasoning_gym:NAME with NAME a reasoning-gym dataset")
    if not isinstance(reference, Mapping) or not isinstance(reference.get("metadata"), Mapping):
        raise ValueError(
            f"{task} reference: expected the dataset entry {{'answer', 'metadata': {{...}}}} that "
            f"`data prepare reasoning-gym` writes, got {reference!r:.200}"
        )


@cache
def scorer(name: str) -> Callable[[str | None, dict], float]:
    """The ``score_answer`` of dataset ``name`` (built once per process: some datasets load word lists)."""
    require_reasoning_gym(f"task {TASK_PREFIX}{name}")
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"reward task {TASK_PREFIX}{name}: reasoning-gym has no dataset {name!r}")
    return reasoning_gym.get_score_answer_fn(name)


def score(task: str, response: str, reference: Mapping[str, Any], answer: str = "tagged") -> float:
    """``score_answer`` of the ``reasoning_gym:NAME`` dataset for one response, its answer read under the format
    ``answer`` (reward.answer); outside [0, 1] is an error."""
    name = dataset_name(task) or ""
    entry = {"question": "", **reference}
    value = scorer(name)(read_answer(response, answer), entry)
    reward = float(value)
    if not 0.0 <= reward <= 1.0:
        raise ValueError(f"{task}: score_answer returned {value!r}; expected a float in [0, 1]")
    return reward
