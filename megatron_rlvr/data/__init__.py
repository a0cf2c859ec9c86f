"""Prompt datasets: local JSONL/Parquet files or the embedded countdown demo, tokenized and batched with a
resumable, seeded order.

    items, stats = load_items(cfg.data, tokenizer, "train")
    loader = PromptLoader(items, cfg.trainer.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    batch = loader.next_batch()            # list[PromptItem]
    state = loader.state_dict()            # {"epoch", "position", ...}: save it with the checkpoint
"""

from megatron_rlvr.data.benchmark_rows import problem_rows
from megatron_rlvr.data.config import DataConfig
from megatron_rlvr.data.dataset import LoadStats, PromptItem, items_from_rows, load_items
from megatron_rlvr.data.loader import PromptLoader
from megatron_rlvr.data.sources import DataError, Row, read_rows

__all__ = [
    "DataConfig",
    "DataError",
    "LoadStats",
    "PromptItem",
    "PromptLoader",
    "Row",
    "items_from_rows",
    "load_items",
    "problem_rows",
    "read_rows",
]
