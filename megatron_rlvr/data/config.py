"""Configuration of the prompt dataset and how prompts become token ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = ""  # JSONL or Parquet; empty = the embedded countdown demo task
    eval_path: str = ""  # held-out prompts for eval; empty with an empty path = the demo task's eval split
    problem_key: str = "problem"
    answer_key: str = "answer"  # the reference: a string or any JSON value (e.g. {"numbers": [...], "target": 24})
    task_key: str = "task"  # a row's reward task when the column is present; else `task` below
    id_key: str = "id"  # a row's stable id when the column is present; else "<file name>:<line>"
    task: str = "countdown"  # reward task type: countdown | math | code | logic
    chat_template: bool = False  # wrap the problem with the tokenizer's chat template (instruct and R1-style models)
    # the system turn under the chat template: null = the template's own default (none, or e.g. SmolLM2's "You are a
    # helpful AI assistant named SmolLM, ..."); a string (even "") replaces it. Needs chat_template: true
    system_prompt: str | None = None
    max_prompt_tokens: int = 256  # longer prompts are skipped (counted, with a warning), never truncated
    shuffle: bool = True
    skip_bad_rows: bool = False  # false: a malformed row is an error naming file and line
    seed: int = 1234
    demo_train_problems: int = 1024  # size of the embedded task's train split (it holds ~5000 in all)
    demo_eval_problems: int = 32  # size of the embedded task's eval split

    def __post_init__(self) -> None:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "data.system_prompt: a system turn needs the chat template; set data.chat_template=true, or "
                "data.system_prompt=null for a raw prompt"
            )
