"""Benchmark problems as dataset rows: the data config's keys, benchmark-qualified ids, rows named within their
benchmark, and the same prompt items as the rows validation used to build by hand."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlvr.data import DataConfig, DataError, Row, items_from_rows, problem_rows
from megatron_rlvr.problems.benchmarks import Problem

PROBLEMS = [
    Problem("math500", "test/algebra/1.json", "1+1?\n\nBox it.", "math", "2", "1+1?"),
    Problem("countdown", "c7", "1 2 -> 3:", "countdown", {"numbers": [1, 2], "target": 3}, "1 2 -> 3:"),
    Problem("math500", "test/algebra/2.json", "2+2?\n\nBox it.", "math", "4", "2+2?"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from megatron_rlvr.demo import MODEL_DIR

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_rows_carry_prompt_reference_task_and_id_under_the_configs_keys():
    cfg = DataConfig(problem_key="q", answer_key="ref", task_key="kind", id_key="uid")
    rows = list(problem_rows(PROBLEMS, cfg))
    assert [r.data for r in rows] == [
        {"q": "1+1?\n\nBox it.", "ref": "2", "kind": "math", "uid": "math500/test/algebra/1.json"},
        {"q": "1 2 -> 3:", "ref": {"numbers": [1, 2], "target": 3}, "kind": "countdown", "uid": "countdown/c7"},
        {"q": "2+2?\n\nBox it.", "ref": "4", "kind": "math", "uid": "math500/test/algebra/2.json"},
    ]
    # named by benchmark and place within it (what an error about the row says)
    assert [(r.source, r.file_name, r.line) for r in rows] == [
        ("math500:1", "math500", 1),
        ("countdown:1", "countdown", 1),
        ("math500:2", "math500", 2),
    ]


def hand_built_rows(bench: str, problems: list[Problem], cfg: DataConfig) -> list[Row]:
    """The rows experience/validation.py built by hand before problem_rows (one benchmark at a time)."""
    return [
        Row(
            f"{bench}:{i}",
            bench,
            i,
            {
                cfg.problem_key: p.prompt,
                cfg.answer_key: p.reference,
                cfg.task_key: p.task,
                cfg.id_key: f"{bench}/{p.problem_id}",
            },
        )
        for i, p in enumerate(problems, start=1)
    ]


@pytest.mark.parametrize("chat_template", [False, True])
def test_the_same_prompt_items_as_validations_hand_built_rows(tokenizer, chat_template):
    cfg = DataConfig(chat_template=chat_template, max_prompt_tokens=4096, skip_bad_rows=False)
    if chat_template:
        tokenizer.chat_template = (
            "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
        )
    try:
        for bench in ("math500", "countdown"):
            problems = [p for p in PROBLEMS if p.benchmark == bench]
            new = items_from_rows(problem_rows(problems, cfg), cfg, tokenizer)[0]
            old = items_from_rows(hand_built_rows(bench, problems, cfg), cfg, tokenizer)[0]
            assert new == old and len(new) == len(problems)
    finally:
        tokenizer.chat_template = None


def test_a_problem_without_a_reference_is_an_error_naming_its_benchmark_and_place(tokenizer):
    empty = dataclasses.replace(PROBLEMS[2], reference="")
    with pytest.raises(DataError, match=r"^math500:2: field 'answer'"):
        items_from_rows(problem_rows([PROBLEMS[0], empty], DataConfig()), DataConfig(), tokenizer)
