"""Verifier plugins a user names in the config: ``reward.plugins: {TASK: "package.module:function"}``.

A spec is ``package.module:function`` (imported from ``sys.path``) or ``FILE.py:function`` (a path to a file,
read relative to the working directory). The function is a `Verifier`: ``fn(response: str, reference) -> float`` in
[0, 1], where ``reference`` is the row's answer column as written (a string or any JSON value). It runs in the
reward pool's worker processes, under the pool's guarantees (see `pool.py`).

`load_plugin` imports a spec once per process (later calls return the cached function) and checks it: a module that
is missing or fails to import, a name that is not there or not callable, or a signature that cannot take
``(response, reference)`` is a `ConfigError` of one line naming the key ``reward.plugins.TASK``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from megatron_rlvr.errors import ConfigError


class Verifier(Protocol):
    """What a plugin is: the reward of one response against the row's reference, a float in [0, 1]."""

    def __call__(self, response: str, reference: Any) -> float: ...


_LOADED: dict[str, Callable[[str, Any], float]] = {}  # spec (file paths resolved) -> the function


def _error(key: str, message: str) -> Exception:
    return ConfigError(f"{key}: {message}")


def _split(key: str, spec: Any, what: str = "function") -> tuple[str, str, bool]:
    """(module or file, attribute name, is a file) of a spec."""
    expected = f"expected 'package.module:{what}' or 'FILE.py:{what}' (a path), got {spec!r}"
    if not isinstance(spec, str) or ":" not in spec:
        raise _error(key, expected)
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        raise _error(key, expected)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    return target, name, is_file


def _import_file(key: str, target: str) -> Any:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise _error(key, f"file {target} not found (relative paths are read from {Path.cwd()})")
    # a stable module name per file, registered in sys.modules so that what the plugin defines pickles
    module_name = "megatron_rlvr_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises is reported on one line
        del sys.modules[module_name]
        raise _error(key, f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _import_module(key: str, target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise _error(key, f"no module named {e.name!r} (install it, or put its directory on PYTHONPATH)") from e
        raise _error(key, f"importing {target} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001
        raise _error(key, f"importing {target} failed: {type(e).__name__}: {e}") from e


def import_spec(key: str, spec: Any, what: str = "function") -> tuple[Any, str]:
    """The attribute a spec names, ``package.module:NAME`` (from ``sys.path``) or ``FILE.py:NAME`` (a path), and the
    spec's resolved form (file paths absolute); a one-line `ConfigError` naming the config ``key`` otherwise. Verifier
    plugins and user environments (environments/loading.py) are both imported this way."""
    target, name, is_file = _split(key, spec, what)
    module = _import_file(key, target) if is_file else _import_module(key, target)
    found = getattr(module, name, None)
    if found is None:
        raise _error(key, f"{target} has no attribute {name!r}")
    return found, (f"{Path(target).expanduser().resolve()}:{name}" if is_file else spec)


def load_plugin(task: str, spec: str) -> Callable[[str, Any], float]:
    """The checked function of ``spec`` (the value of ``reward.plugins.<task>``), imported once per process."""
    key = f"reward.plugins.{task}"
    target, name, is_file = _split(key, spec)
    resolved = f"{Path(target).expanduser().resolve()}:{name}" if is_file else spec
    if resolved in _LOADED:
        return _LOADED[resolved]
    fn, _ = import_spec(key, spec)
    if not callable(fn):
        raise _error(key, f"{target}:{name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("response", "reference")
    except TypeError:
        raise _error(
            key,
            f"{target}:{name}{inspect.signature(fn)} cannot be called as "
            f"fn(response, reference); expected fn(response, reference) -> float in [0, 1]",
        ) from None
    except ValueError:  # no signature to read (some builtins): the first call will tell
        pass
    _LOADED[resolved] = fn
    return fn


def check_plugins(plugins: Mapping[str, Any], reserved: Callable[[str], str | None]) -> None:
    """Load every plugin of ``reward.plugins``; ``reserved(task)`` says why a task name is taken, or None."""
    if not isinstance(plugins, Mapping):
        raise _error("reward.plugins.<task>", f"expected a mapping of task names to specs, got {plugins!r}")
    for task, spec in plugins.items():
        if not isinstance(task, str) or not task.strip():
            raise _error(f"reward.plugins.{task}", "a task name must be a non-empty string")
        why = reserved(task)
        if why:
            raise _error(f"reward.plugins.{task}", why)
        load_plugin(task, spec)


def plugin_reward(task: str, fn: Callable[[str, Any], float], response: str, reference: Any) -> float:
    """The plugin's value as a reward; a value that is not a number in [0, 1] is an error naming the key."""
    value = fn(response, reference)
    if isinstance(value, bool):
        return float(value)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"reward.plugins.{task} returned {value!r:.80}; expected a float in [0, 1]") from None
    if not 0.0 <= reward <= 1.0:  # also refuses nan
        raise ValueError(f"reward.plugins.{task} returned {reward!r}; expected a float in [0, 1]")
    return reward
