"""Turn dataset rows (or the embedded demo task) into prompt items: text, token ids, reference answer, task, id.

Bad rows raise a DataError naming file and line, or are counted and skipped when ``skip_bad_rows`` is set.
Prompts longer than ``max_prompt_tokens`` are counted and skipped with one warning: never truncated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.data.sources import DataError, Row, read_rows
from megatron_rlvr.problems.prompt_encoding import ChatTemplateMissing, PromptTokenizer, encode_prompt

logger = logging.getLogger(__name__)

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class PromptItem:
    id: str  # stable across runs: the row's id column, else "<file name>:<line>"; the demo's problem id
    prompt: str  # the text the model continues (after the chat template, when that is on)
    prompt_ids: tuple[int, ...]
    answer: Any  # the reference handed to the verifier: a string or a JSON value (dict, list, number)
    task: str  # the reward task name (rewards.score's first argument)
    problem: str = ""  # the raw problem text before any template


@dataclass
class LoadStats:
    rows: int = 0
    bad_rows: int = 0
    too_long: int = 0
    bad_examples: list[str] = field(default_factory=list)  # the first few "file:line: reason"


def load_items(
    cfg: DataConfig, tokenizer: PromptTokenizer, split: Split = "train"
) -> tuple[list[PromptItem], LoadStats]:
    """All prompt items of ``split``: from ``cfg.path`` / ``cfg.eval_path``, or the demo task when both are empty."""
    if split not in ("train", "eval"):
        raise DataError(f"split: expected 'train' or 'eval', got {split!r}")
    path = cfg.path if split == "train" else cfg.eval_path
    if not path and not cfg.path:
        rows = _demo_rows(cfg, split)
    elif not path:
        raise DataError(f"data.eval_path: empty while data.path={cfg.path!r} is set; give the eval prompts' file")
    else:
        rows = read_rows(path)
    items, stats = items_from_rows(rows, cfg, tokenizer)
    if not items:
        raise DataError(f"dataset {path or 'demo task'} ({split}): no usable prompts ({_describe(stats, cfg)})")
    return items, stats


def _describe(stats: LoadStats, cfg: DataConfig) -> str:
    return (
        f"{stats.rows} rows, {stats.bad_rows} bad rows skipped, "
        f"{stats.too_long} prompts longer than data.max_prompt_tokens={cfg.max_prompt_tokens} skipped"
    )


def _demo_rows(cfg: DataConfig, split: Split) -> Iterable[Row]:
    from megatron_rlvr.tasks import countdown as task

    count = cfg.demo_train_problems if split == "train" else cfg.demo_eval_problems
    for i, p in enumerate(task.generate(cfg.seed, count, split), start=1):
        data = {cfg.problem_key: p.prompt, cfg.answer_key: p.reference, cfg.task_key: "countdown", cfg.id_key: p.id}
        yield Row(f"<demo {split}>:{i}", f"demo-{split}", i, data)


def items_from_rows(
    rows: Iterable[Row], cfg: DataConfig, tokenizer: PromptTokenizer
) -> tuple[list[PromptItem], LoadStats]:
    """Rows -> prompt items under ``cfg``'s field names, template and length policy (also used for eval sets); the
    prompt's text and ids are problems/prompt_encoding.py's `encode_prompt` of the row's problem."""
    stats = LoadStats()
    items: list[PromptItem] = []
    first_long = ""
    for row in rows:
        stats.rows += 1
        try:
            problem, answer, task, item_id = _fields(row, cfg)
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise
            stats.bad_rows += 1
            if len(stats.bad_examples) < 5:
                stats.bad_examples.append(str(e))
            continue
        try:
            encoded = encode_prompt(
                tokenizer, problem, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt
            )
        except ChatTemplateMissing:
            raise DataError(
                "data.chat_template=true but the tokenizer has no chat template; set data.chat_template=false "
                "or use a tokenizer whose tokenizer_config.json defines one"
            ) from None
        if len(encoded.ids) > cfg.max_prompt_tokens:
            stats.too_long += 1
            first_long = first_long or f"{row.source} ({len(encoded.ids)} tokens)"
            continue
        items.append(PromptItem(item_id, encoded.text, encoded.ids, answer, task, problem))
    if stats.bad_rows:
        logger.warning(
            "skipped %d bad dataset rows (data.skip_bad_rows=true); first: %s",
            stats.bad_rows,
            "; ".join(stats.bad_examples),
        )
    if stats.too_long:
        logger.warning(
            "skipped %d prompts longer than data.max_prompt_tokens=%d (not truncated); first: %s",
            stats.too_long,
            cfg.max_prompt_tokens,
            first_long,
        )
    return items, stats


def _fields(row: Row, cfg: DataConfig) -> tuple[str, Any, str, str]:
    if row.data is None:
        raise DataError(f"{row.source}: {row.error}")
    problem = row.data.get(cfg.problem_key)
    if not isinstance(problem, str) or not problem.strip():
        got = "missing" if problem is None else f"got {problem!r:.60}"
        raise DataError(f"{row.source}: field {cfg.problem_key!r} (data.problem_key) must be a non-empty string, {got}")
    answer = row.data.get(cfg.answer_key)
    if answer is None or answer == "":
        raise DataError(
            f"{row.source}: field {cfg.answer_key!r} (data.answer_key) is missing or empty; every row needs its "
            f"reference answer (set data.skip_bad_rows=true to skip such rows)"
        )
    task = row.data.get(cfg.task_key) or cfg.task
    if not isinstance(task, str):
        raise DataError(f"{row.source}: field {cfg.task_key!r} (data.task_key) must be a task name, got {task!r:.60}")
    item_id = row.data.get(cfg.id_key)
    item_id = f"{row.file_name}:{row.line}" if item_id is None or item_id == "" else str(item_id)
    return problem, answer, task, item_id
