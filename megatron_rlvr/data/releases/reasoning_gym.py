"""reasoning-gym's procedural tasks as training rows (``data prepare reasoning-gym --tasks NAME[,NAME...] --size N
--seed S``), generated here rather than read from a download.

Each task NAME is reasoning-gym's dataset of that name, made with ``create_dataset(NAME, size=N, seed=S, **config)``
(``--config NAME.KEY=VALUE`` sets a field of its config): N entries, a pure function of the seed and the config.
Most datasets draw entry i from ``Random(seed + i)``: seeds S and S + 1 share all entries but one, so sets meant
to be disjoint (train and eval) need seeds at least N apart.
Each entry becomes the row ``{"id": "reasoning_gym-NAME-S-<index>", "problem": <question>, "answer": {"answer":
<gold or null>, "metadata": {...}, <any other field of the entry>}, "task": "reasoning_gym:NAME", "source":
"reasoning-gym"}``; the question gets an instruction to answer between ``<answer>`` tags unless --no-instruction.

The entry is written as JSON: tuples become lists, numpy scalars and arrays plain numbers and lists, sets sorted
lists. An entry whose gold answer scores differently through the reward (`megatron_rlvr.rewards.reasoning_gym`)
on the row as written than by ``score_answer`` on the entry as generated is skipped, counted with that reason: its
scorer needs something JSON does not keep.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_rlvr.data.releases.base import Skip
from megatron_rlvr.data.sources import DataError

ANSWER_INSTRUCTION = "\n\nGive only your final answer, between <answer> and </answer>."
SOURCE = "reasoning-gym"


@dataclass
class GymReport:
    generated: int = 0
    duplicates: int = 0
    held_out: int = 0  # rows dropped because a --disjoint-from file holds their question
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skipped: dict[str, str] = field(default_factory=dict)  # reason -> row id


def _registry() -> dict[str, Any]:
    from megatron_rlvr.rewards.reasoning_gym import require_reasoning_gym

    require_reasoning_gym("data prepare reasoning-gym")
    import reasoning_gym  # noqa: F401 - registers the datasets
    from reasoning_gym.factory import DATASETS

    return DATASETS


def parse_tasks(text: str) -> list[str]:
    """--tasks "a,b" -> ["a", "b"]: known reasoning-gym datasets, each once; DataError naming an unknown one."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    if not names:
        raise DataError("--tasks: give one or more reasoning-gym dataset names, e.g. --tasks leg_counting,countdown")
    known = _registry()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(known)} are registered"
            raise DataError(f"--tasks: reasoning-gym has no dataset {name!r}{hint}")
    if len(set(names)) != len(names):
        raise DataError(f"--tasks {text!r}: a task is named twice")
    return names


def parse_config(items: Sequence[str], tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """--config NAME.KEY=VALUE (VALUE read as YAML) -> {NAME: {KEY: VALUE}}; NAME must be one of --tasks."""
    out: dict[str, dict[str, Any]] = {name: {} for name in tasks}
    for item in items or ():
        head, sep, raw = item.partition("=")
        name, dot, key = head.strip().partition(".")
        if not sep or not dot or not key:
            raise DataError(f"--config {item!r}: expected NAME.KEY=VALUE, e.g. --config countdown.max_numbers=4")
        if name not in out:
            raise DataError(f"--config {item!r}: {name!r} is not one of --tasks {list(tasks)}")
        out[name][key] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def _create(name: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except TypeError as e:  # an unknown config field
        raise DataError(f"--config {name}: {e}") from None
    except (AssertionError, ValueError) as e:  # the config's own validate()
        raise DataError(f"--config {name}: reasoning-gym refuses {config}: {e or 'invalid value'}") from None


def plain(value: Any, where: str = "metadata") -> Any:
    """``value`` as JSON data (tuples -> lists, numpy -> numbers, sets -> sorted lists); Skip if it cannot be."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Skip(f"{where} holds the non-finite number {value}")
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Skip(f"{where} has keys that are not strings")
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, where) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v, where) for v in value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return plain(value.tolist(), where)
    raise Skip(f"{where} holds a {type(value).__name__}, which JSON cannot keep")


def _reference(entry: dict[str, Any]) -> dict[str, Any]:
    reference = plain({k: v for k, v in entry.items() if k != "question"}, "entry")
    if not isinstance(reference.get("metadata"), dict):
        raise Skip("the entry has no metadata dict")
    return reference


def _check_gold(name: str, dataset: Any, entry: dict[str, Any], reference: dict[str, Any]) -> None:
    from megatron_rlvr.rewards.reasoning_gym import TASK_PREFIX, score

    gold = entry.get("answer")
    if not isinstance(gold, str):
        return  # no single gold answer (a task with many right ones): nothing to compare
    try:
        as_generated = float(dataset.score_answer(gold, entry))
        as_written = score(TASK_PREFIX + name, gold, reference)
    except Exception as e:  # noqa: BLE001 - a scorer that fails on its own gold answer
        raise Skip(f"score_answer fails on the gold answer ({type(e).__name__})") from None
    if as_written != as_generated:
        raise Skip(
            f"the gold answer scores {as_written:g} on the row as written but {as_generated:g} as generated "
            f"(the metadata does not survive JSON)"
        )


def questions_of(paths: Sequence[str]) -> frozenset[str]:
    """The questions (task and exact text) of prepared reasoning-gym files, for `generate_rows`' ``held_out``;
    DataError naming a file that is missing or holds a row that is not a reasoning-gym row."""
    import json

    questions = set()
    for path in paths:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise DataError(f"--disjoint-from {path}: cannot read it ({e.strerror})") from None
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                task, problem = row["task"], row["problem"]
            except (ValueError, KeyError, TypeError):
                raise DataError(
                    f"--disjoint-from {path}:{line_no}: not a row of `data prepare reasoning-gym` "
                    "(expected JSON with 'task' and 'problem')"
                ) from None
            questions.add(_question_key(str(task).removeprefix("reasoning_gym:"), _question(str(problem))))
    return frozenset(questions)


def _question(problem: str) -> str:
    """The question of a row's problem text: the text less the answer instruction it may carry."""
    return problem.removesuffix(ANSWER_INSTRUCTION).strip()


def _question_key(name: str, question: str) -> str:
    return name + "\0" + question.strip()  # exact text: "3 + 4" and "3 - 4" are two problems


def generate_rows(
    tasks: Iterable[str],
    size: int,
    seed: int,
    configs: dict[str, dict[str, Any]],
    instruction: bool,
    report: GymReport,
    held_out: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """The rows of every task (module docstring), repeated questions kept once, unusable entries counted; a row
    whose question is in ``held_out`` (`questions_of`) is dropped and counted."""
    if size < 1:
        raise DataError(f"--size {size}: expected the number of rows per task, >= 1")
    rows, seen = [], set()
    for name in tasks:
        dataset = _create(name, size, seed, configs.get(name, {}))
        for index in range(size):
            row_id = f"reasoning_gym-{name}-{seed}-{index}"
            entry = dataset[index]
            report.generated += 1
            try:
                question = entry.get("question")
                if not isinstance(question, str) or not question.strip():
                    raise Skip("the entry has no question")
                reference = _reference(entry)
                _check_gold(name, dataset, entry, reference)
            except Skip as e:
                report.skipped[str(e)] = report.skipped.get(str(e), 0) + 1
                report.first_skipped.setdefault(str(e), row_id)
                continue
            key = _question_key(name, question)
            if key in held_out:
                report.held_out += 1
                continue
            if key in seen:
                report.duplicates += 1
                continue
            seen.add(key)
            rows.append(
                {
                    "id": row_id,
                    "problem": question + (ANSWER_INSTRUCTION if instruction else ""),
                    "answer": reference,
                    "task": f"reasoning_gym:{name}",
                    "source": SOURCE,
                }
            )
    return rows


def summary(report: GymReport) -> str:
    parts = [f"generated {report.generated} entries"]
    for reason, count in sorted(report.skipped.items(), key=lambda kv: -kv[1]):
        parts.append(f"skipped {count}: {reason} (first: {report.first_skipped[reason]})")
    if report.duplicates:
        parts.append(f"{report.duplicates} repeated questions kept once")
    if report.held_out:
        parts.append(f"{report.held_out} dropped as held out (--disjoint-from)")
    return "; ".join(parts)
