"""Code releases with tests: DeepCoder (agentica-org/DeepCoder-Preview-Dataset: ``problem``, ``tests`` as a JSON
string, ``starter_code``, ``metadata``; subsets lcbv5, primeintellect, taco, codeforces) and LiveCodeBench
(code_generation_lite: ``question_content``, ``public_test_cases`` / ``private_test_cases``).

Tests become the code verifier's references: stdin/stdout cases -> ``{"io": [...]}``; LeetCode-style functional
cases with ``metadata.func_name`` -> ``{"tests": asserts on Solution().<func_name>}``. Call-based cases without a
class (primeintellect / TACO ``fn_name``) are skipped and counted: the verifier has no harness for them.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_rlvr.data.releases.base import Options, Prepared, Release, Skip, first
from megatron_rlvr.problems.benchmark_formats import (
    CODE_SUFFIX,
    STARTER_INSTRUCTION,
    STDIN_INSTRUCTION,
    functional_tests_as_asserts,
)


def _tests(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise Skip("'tests' is not valid JSON") from None
    return value


def _io(inputs: list, outputs: list) -> dict:
    def text(v):
        return v if isinstance(v, str) else "\n".join(map(str, v)) if isinstance(v, list) else str(v)

    return {"io": [{"input": text(i), "output": text(o)} for i, o in zip(inputs, outputs)]}


def convert_deepcoder(record: dict, options: Options) -> Prepared:
    problem = first(record, "problem", "question")
    if not isinstance(problem, str):
        raise Skip("no 'problem' text")
    tests = _tests(record.get("tests"))
    starter = first(record, "starter_code") or ""
    if isinstance(tests, dict):  # TACO / APPS: {"inputs": [...], "outputs": [...], "fn_name"?}
        if tests.get("fn_name"):
            raise Skip("call-based tests (fn_name) have no harness in the code verifier")
        if not tests.get("inputs"):
            raise Skip("no test cases")
        return Prepared(
            problem, _io(tests["inputs"], tests.get("outputs", [])), "code", problem + STDIN_INSTRUCTION + CODE_SUFFIX
        )
    if not isinstance(tests, list) or not tests:
        raise Skip("no test cases in 'tests'")
    kinds = {str(t.get("testtype") or t.get("type")) for t in tests if isinstance(t, dict)}
    if kinds <= {"stdin", "stdin_stdout"}:
        if any(not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str) for t in tests):
            raise Skip("a stdin/stdout case without string 'input' and 'output'")
        return Prepared(
            problem,
            _io([t["input"] for t in tests], [t["output"] for t in tests]),
            "code",
            problem + STDIN_INSTRUCTION + CODE_SUFFIX,
        )
    if kinds == {"functional"}:
        metadata = record.get("metadata") or {}
        metadata = json.loads(metadata) if isinstance(metadata, str) else metadata
        func_name = metadata.get("func_name") if isinstance(metadata, dict) else None
        if not func_name:
            raise Skip("functional tests without metadata.func_name")
        try:
            reference = {"tests": functional_tests_as_asserts(tests, func_name)}
        except (ValueError, KeyError, TypeError) as e:
            raise Skip(f"functional test cases are not one JSON value per line ({e})") from None
        return Prepared(problem, reference, "code", problem + STARTER_INSTRUCTION.format(starter=starter) + CODE_SUFFIX)
    raise Skip(f"test type {sorted(kinds)} has no harness in the code verifier")


def convert_livecodebench(record: dict, options: Options) -> Prepared:
    from megatron_rlvr.problems.benchmarks import BENCHMARKS, Row

    spec = BENCHMARKS["livecodebench"]
    try:
        p = spec.build(Row(record, "row", spec.layout), 0, "livecodebench")
    except ValueError as e:
        raise Skip(str(e).removeprefix("row: ")) from None
    return Prepared(p.text, p.reference, "code", p.prompt, str(first(record, "question_id") or ""))


DEEPCODER = Release(
    "deepcoder",
    convert_deepcoder,
    "DeepCoder: 'problem', 'tests' (JSON: stdin/stdout or functional "
    "cases), 'starter_code', 'metadata.func_name'; <subset>/train-*.parquet",
)
LIVECODEBENCH = Release(
    "livecodebench",
    convert_livecodebench,
    "LiveCodeBench code_generation_lite: 'question_id', "
    "'question_content', 'starter_code', 'public_test_cases', 'private_test_cases', 'metadata'",
)
