"""SynLogic's official per-task verifiers, read from a user's checkout of github.com/MiniMax-AI/SynLogic.

The checkout's interface (the repository's layout): ``task2verifier.py`` at its root defines ``verifier_classes``,
a dict from a task name (a row's ``data_source``: "arrow_maze", "sudoku", "bbh_web_of_lies", ...) to a class whose
instances have ``verify(data, test_solution) -> bool | float``; ``data`` is a ``base.data.Data(question, answer,
difficulty, metadata)`` and ``test_solution`` the whole response (each verifier extracts its own answer: an
``<answer>`` tag, a fenced block, ...). task2verifier imports every task's verifier module
(``games/tasks/<task>/scripts/..._verifier.py``, ``corpus/misc/tasks/...``) with the checkout on ``sys.path``.

The reference of a SynLogic row (written by ``data prepare synlogic``) is ``{"data_source", "answer", "metadata",
"question", "difficulty"}``: the release's ``extra_info.game_data_str``, which is what SynLogic's own reward code
builds ``Data`` from. Verifiers print as they go; their stdout and stderr are discarded.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_rlvr.errors import ConfigError


def _error(message: str) -> Exception:
    return ConfigError(f"reward.synlogic_dir: {message}")


class SynLogicVerifiers:
    """The official verifiers of one checkout: ``tasks`` (the names it verifies) and ``verify``."""

    _CHECKOUTS: dict[Path, SynLogicVerifiers] = {}

    def __init__(self, root: Path, classes: Mapping[str, type], data_cls: type):
        self.root, self._classes, self._data_cls = root, dict(classes), data_cls
        self._instances: dict[str, Any] = {}
        self.tasks = frozenset(self._classes)

    @classmethod
    def load(cls, synlogic_dir: str) -> SynLogicVerifiers:
        """The checkout at ``synlogic_dir``, imported once per process; ConfigError naming the key if unusable."""
        root = Path(synlogic_dir).expanduser().resolve()
        if root in cls._CHECKOUTS:
            return cls._CHECKOUTS[root]
        expected = "a checkout of github.com/MiniMax-AI/SynLogic (task2verifier.py at its root)"
        if not root.is_dir():
            raise _error(f"{synlogic_dir} is not a directory; expected {expected}")
        entry = root / "task2verifier.py"
        if not entry.is_file():
            raise _error(f"{synlogic_dir} has no task2verifier.py; expected {expected}")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))  # task2verifier's own imports: games.tasks..., base.data
        try:
            with _quiet():
                spec = importlib.util.spec_from_file_location("task2verifier", entry)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                data_module = importlib.import_module("base.data")
        except Exception as e:  # noqa: BLE001 - a broken or incomplete checkout, reported on one line
            hint = (
                f" (install the checkout's requirements: pip install -r {root / 'requirements.txt'})"
                if isinstance(e, ModuleNotFoundError)
                else ""
            )
            raise _error(f"importing {entry} failed: {type(e).__name__}: {e}{hint}") from e
        classes = getattr(module, "verifier_classes", None)
        if not isinstance(classes, Mapping) or not classes:
            raise _error(f"{entry} defines no verifier_classes dict (task name -> verifier class)")
        data_cls = getattr(data_module, "Data", None)
        if not isinstance(data_cls, type):
            raise _error(f"{root / 'base' / 'data.py'} defines no Data class")
        checkout = cls(root, classes, data_cls)
        cls._CHECKOUTS[root] = checkout
        return checkout

    def verify(self, task: str, response: str, reference: Mapping[str, Any]) -> float:
        """The official verifier's reward for one response (True -> 1.0); a value outside [0, 1] is an error."""
        verifier = self._instances.get(task)
        if verifier is None:
            verifier = self._instances[task] = self._classes[task]()
        data = self._data_cls(
            question=reference.get("question") or "",
            answer=reference.get("answer"),
            difficulty=reference.get("difficulty") or 1,
            metadata=reference.get("metadata"),
        )
        with _quiet():
            value = verifier.verify(data, response)
        reward = float(bool(value)) if isinstance(value, bool) or value is None else float(value)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"SynLogic verifier of {task!r} returned {value!r}; expected a bool or a float in [0, 1]")
        return reward


@contextlib.contextmanager
def _quiet():
    """SynLogic's code prints on import and in every verify; none of it may reach the trainer's console."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield
