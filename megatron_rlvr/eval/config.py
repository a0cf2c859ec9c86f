"""Configuration of large-K evaluation runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EvalConfig:
    n_samples: int = 64  # answers sampled per problem (up to 1024)
    chunk: int = 64  # samples per problem in one request; the unit of seeding and of resuming
    # sequences per engine request: a request holds chunk j of max(1, request_samples // chunk) problems, so the
    # engine always sees a full batch (its scheduler takes what fits); part of the stored samples' settings
    request_samples: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    dtype: Literal["float32", "bfloat16"] = "float32"  # the engines' weights and compute (bfloat16 on GPU recipes)
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    seed: int = 1234  # each chunk's sampling seed derives from (seed, benchmark, problem id, chunk index)
    benchmarks: list[str] = field(default_factory=list)
    data_dir: str = "data"
    output_dir: str = "outputs/eval"
    limit: int = 0  # problems per benchmark (0 = all)
    chat_template: bool = (
        False  # wrap each prompt with the tokenizer's chat template (sampling stops at its end of turn)
    )
    system_prompt: str | None = None  # the system turn under the chat template; None: the template's own default
    save_text: bool = True  # keep each sample's text in the records (large at n = 1024)
