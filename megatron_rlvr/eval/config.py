"""Configuration of large-K evaluation runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rlvr.settings import setting


@dataclass
class EvalConfig:
    """Sampling for validation (``trainer.eval_every``) and large-K evaluation (`megatron-rlvr eval`)."""

    n_samples: int = setting(64, "Answers sampled per problem (up to 1024).", ge=1)
    chunk: int = setting(64, "Samples per problem in one request; the unit of seeding and of resuming.", ge=1)
    request_samples: int = setting(
        4096,
        "Sequences per engine request: a request holds chunk j of max(1, request_samples // chunk) problems, so the "
        "engine always sees a full batch (its scheduler takes what fits); part of the stored samples' settings.",
        ge=1,
    )
    temperature: float = setting(1.0, "Sampling temperature.", ge=0)
    top_p: float = setting(1.0, "Nucleus sampling's probability mass.", gt=0, le=1)
    dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "The engines' weights and compute (bfloat16 on GPU recipes)."
    )
    max_new_tokens: int = setting(512, "The answer's token budget.", ge=1)
    stop: list[str] = setting(factory=list, doc="Stop strings (empty: validation uses rollout.stop).")
    seed: int = setting(1234, "Each chunk's sampling seed derives from (seed, benchmark, problem id, chunk index).")
    benchmarks: list[str] = setting(factory=list, doc="The benchmarks to evaluate (docs/evaluation.md).")
    data_dir: str = setting("data", "Where the benchmarks' files are.")
    output_dir: str = setting("outputs/eval", "Where samples and results go.")
    limit: int = setting(0, "Problems per benchmark (0 = all).", ge=0)
    chat_template: bool = setting(
        False, "Wrap each prompt with the tokenizer's chat template (sampling stops at its end of turn)."
    )
    system_prompt: str | None = setting(
        None, "The system turn under the chat template; null: the template's own default."
    )
    save_text: bool = setting(True, "Keep each sample's text in the records (large at n = 1024).")
