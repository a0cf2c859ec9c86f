"""Code answers: take the program out of the response and run it against the benchmark's tests in the sandbox.

Program extraction: the last fenced block whose language tag is python/py/python3 (or untagged); no fence means the
whole response is the program.

Two reference formats (a dict):
- ``{"tests": str, "entry_point": str (optional), "prelude": str (optional)}`` — HumanEval(+)-style: the prelude
  (e.g. the prompt's imports, which a model's function may rely on without repeating), the program, then the test
  code (asserts, or a ``def check(candidate)``), then ``check(<entry_point>)`` when an entry point is given, run
  once; exit status 0 passes.
- ``{"io": [{"input": str, "output": str}, ...]}`` — LiveCodeBench-style stdin/stdout: the program runs once per
  case with ``input`` on stdin (all cases in one sandbox, a fresh process and limits per case); it passes when its
  stdout equals ``output`` line by line after stripping trailing whitespace of each line and blank lines at the end.
  All cases must pass; a crash or timeout stops the runs.
Any crash, timeout, limit hit or wrong output scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megatron_rlvr.rewards.sandbox import SandboxLimits, run_python, run_python_many

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}


def extract_program(response: str) -> str:
    blocks = [body for tag, body in _FENCE.findall(response) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else response


def check_code_reference(reference: Any) -> None:
    """ValueError naming the field when a code reference is neither the tests nor the io format."""
    expected = (
        "a dict with 'tests' (str, optional 'entry_point', 'prelude') or 'io' (list of {'input': str, 'output': str})"
    )
    if not isinstance(reference, Mapping):
        raise ValueError(f"code reference: expected {expected}, got {type(reference).__name__}")
    if "tests" in reference:
        if not isinstance(reference["tests"], str):
            raise ValueError(f"code reference: 'tests' must be a string of Python test code; expected {expected}")
        if not isinstance(reference.get("prelude", ""), str):
            raise ValueError("code reference: 'prelude' must be a string of Python code")
        entry = reference.get("entry_point")
        if entry is not None and (not isinstance(entry, str) or not entry.isidentifier()):
            raise ValueError(f"code reference: 'entry_point' must be a Python identifier, got {entry!r:.100}")
        return
    cases = reference.get("io")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"code reference: expected {expected}; keys present: {sorted(reference)}")
    for i, case in enumerate(cases):
        if (
            not isinstance(case, Mapping)
            or not isinstance(case.get("input"), str)
            or not isinstance(case.get("output"), str)
        ):
            raise ValueError(f"code reference: io[{i}] must be {{'input': str, 'output': str}}, got {case!r:.200}")


def _normalize_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def verify_code(response: str, reference: Mapping[str, Any], limits: SandboxLimits | None = None) -> float:
    """1.0 when the response's program passes every test of ``reference``, else 0.0."""
    check_code_reference(reference)
    program = extract_program(response)
    if not program.strip():
        return 0.0
    if "tests" in reference:
        source = f"{reference.get('prelude', '')}\n{program}\n\n{reference['tests']}\n"
        if reference.get("entry_point"):
            source += f"\ncheck({reference['entry_point']})\n"
        result = run_python(source, "", limits)
        return 1.0 if result.returncode == 0 and not result.timed_out else 0.0
    cases = reference["io"]
    results = run_python_many(program, [case["input"] for case in cases], limits)  # one sandbox for all cases
    if len(results) != len(cases):
        return 0.0
    for case, result in zip(cases, results):
        if result.returncode != 0 or result.timed_out:
            return 0.0
        if _normalize_output(result.stdout) != _normalize_output(case["output"]):
            return 0.0
    return 1.0
