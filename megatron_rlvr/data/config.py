"""Configuration of the prompt dataset and how prompts become token ids."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlvr.settings import setting


@dataclass
class DataConfig:
    """The prompt dataset, its columns and how a prompt becomes token ids."""

    path: str = setting("", "JSONL or Parquet; empty = the embedded countdown demo task.")
    eval_path: str = setting("", "Held-out prompts for eval; empty with an empty path = the demo task's eval split.")
    problem_key: str = setting("problem", "The column holding the problem text.")
    answer_key: str = setting(
        "answer", "The column holding the reference: a string or any JSON value (e.g. {numbers: [...], target: 24})."
    )
    task_key: str = setting("task", "The column holding a row's reward task when present; else `task` below.")
    id_key: str = setting("id", "The column holding a row's stable id when present; else '<file name>:<line>'.")
    task: str = setting("countdown", "The reward task of rows without one: countdown | math | code | logic.")
    chat_template: bool = setting(
        False, "Wrap the problem with the tokenizer's chat template (instruct and R1-style models)."
    )
    system_prompt: str | None = setting(
        None,
        "The system turn under the chat template: null = the template's own default (none, or e.g. SmolLM2's 'You "
        "are a helpful AI assistant named SmolLM, ...'); a string (even '') replaces it. Needs chat_template: true.",
    )
    max_prompt_tokens: int = setting(
        256, "Longer prompts are skipped (counted, with a warning), never truncated.", ge=1
    )
    shuffle: bool = setting(True, "Shuffle the prompts each epoch (the order is a function of seed and epoch).")
    skip_bad_rows: bool = setting(False, "Skip a malformed row (counted); false: an error naming file and line.")
    seed: int = setting(1234, "The data order's seed.")
    demo_train_problems: int = setting(1024, "Size of the embedded task's train split (it holds ~5000 in all).", ge=1)
    demo_eval_problems: int = setting(32, "Size of the embedded task's eval split.", ge=1)
