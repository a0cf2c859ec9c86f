"""Math releases: hendrycks MATH (answer = the solution's last \\boxed{}), GSM8K (answer after '####'), and
DAPO-Math-17k (the problem inside DAPO's instruction wrapper, answer in ``reward_model.ground_truth``)."""

from __future__ import annotations

import re

from megatron_rlvr.data.releases.base import Options, Prepared, Release, Skip, chat_text, first
from megatron_rlvr.problems.benchmark_formats import MATH_SUFFIX


def _with_instruction(problem: str, options: Options) -> str:
    return problem + MATH_SUFFIX if options.instruction else problem


def _level(value: object) -> int | None:
    match = re.search(r"\d+", str(value)) if value is not None else None
    return int(match.group()) if match else None


def convert_math(record: dict, options: Options) -> Prepared:
    from megatron_rlvr.rewards.answers import last_boxed

    problem = first(record, "problem", "Problem")
    if not isinstance(problem, str):
        raise Skip("no 'problem' text")
    if options.levels is not None:
        level = _level(record.get("level"))
        if level is None:
            raise Skip(f"level {record.get('level')!r} is not a number")
        if level not in options.levels:
            raise Skip(f"level {level} not in --levels")
    solution = first(record, "solution", "Solution")
    answer = last_boxed(str(solution)) if solution is not None else None
    if not answer or not answer.strip():
        raise Skip("no \\boxed{} answer in 'solution'")
    return Prepared(
        problem, answer.strip(), "math", _with_instruction(problem, options), str(first(record, "unique_id") or "")
    )


def convert_gsm8k(record: dict, options: Options) -> Prepared:
    question, solution = first(record, "question"), first(record, "answer")
    if not isinstance(question, str):
        raise Skip("no 'question' text")
    if not isinstance(solution, str) or "####" not in solution:
        raise Skip("no '#### <answer>' in 'answer'")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise Skip("nothing after '####' in 'answer'")
    return Prepared(question, answer, "math", _with_instruction(question, options))


_DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\..*?to the problem\.\s*", re.DOTALL)
_DAPO_TAIL = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def convert_dapo(record: dict, options: Options) -> Prepared:
    prompt = chat_text(first(record, "prompt", "problem"))
    if not prompt:
        raise Skip("no 'prompt' (chat messages or text)")
    problem = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", prompt)).strip()
    reward_model = record.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    answer = answer if answer not in (None, "") else first(record, "answer", "solution")
    if answer is None or not str(answer).strip():
        raise Skip("no 'reward_model.ground_truth' (or 'answer')")
    extra = record.get("extra_info")
    rid = extra.get("index") if isinstance(extra, dict) else None
    return Prepared(problem, str(answer).strip(), "math", _with_instruction(problem, options), str(rid or ""))


MATH = Release(
    "math",
    convert_math,
    "hendrycks MATH: 'problem', 'level' ('Level 3'), 'solution' (answer = its last "
    "\\boxed{}); the tarball's train/<subject>/<n>.json or HF parquet/jsonl",
    uses_levels=True,
)
GSM8K = Release(
    "gsm8k",
    convert_gsm8k,
    "GSM8K (openai/gsm8k): 'question', 'answer' ending in '#### <number>'; data/train.jsonl or main/train-*.parquet",
)
DAPO = Release(
    "dapo-math-17k",
    convert_dapo,
    "DAPO-Math-17k: 'prompt' (chat messages; DAPO's instruction wrapper is "
    "removed), 'reward_model.ground_truth', 'extra_info.index'; data/dapo-math-17k.parquet",
)
