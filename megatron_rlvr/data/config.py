"""Configuration of the prompt dataset and how prompts become token ids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = ""  # JSONL or Parquet; empty = the embedded countdown demo task
    problem_key: str = "problem"
    answer_key: str = "answer"
    task: str = "countdown"  # reward task type: countdown | math | code | logic
    chat_template: bool = False  # wrap the problem with the tokenizer's chat template
    max_prompt_tokens: int = 256
    shuffle: bool = True
    skip_bad_rows: bool = False  # false: a malformed row is an error naming file and line
    seed: int = 1234
