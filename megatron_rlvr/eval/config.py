"""Configuration of large-K evaluation runs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    n_samples: int = 64  # answers sampled per problem (up to 1024)
    chunk: int = 64  # samples asked from the engine per request
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    benchmarks: list[str] = field(default_factory=list)
    data_dir: str = "data"
    output_dir: str = "outputs/eval"
