"""The GPU check's derived figures (tools/gpu_check/summary.py) on synthetic stage results: SDPA's update rate over
the unfused attention's per layout, and each device's bf16 distance from fp32 with and without fp32 sums."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[3] / "tools" / "gpu_check"


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("gpu_check_test_summary", CHECK / "summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _throughput(**rates):
    return {"layouts": {k: {"status": "ok", "updates": [{"tokens_per_s": r} for r in v]} for k, v in rates.items()}}


def test_sdpa_over_unfused_per_common_layout(summary):
    sdpa = _throughput(padded=[30000, 32000], packed=[40000, 40000], packed_budget=[41000])
    unfused = _throughput(padded=[15500, 15500], packed=[20000, 20000])
    assert summary.attention_speedups(sdpa, unfused) == {"padded": 2.0, "packed": 2.0}
    assert summary.attention_speedups(sdpa, None) == {}


def _compare(cuda_drift: float, cpu_drift: float):
    drift = {"cuda": {"logp_after_max_abs": cuda_drift}, "cpu": {"logp_after_max_abs": cpu_drift}}
    return {"runs": {"bfloat16/padded": {"ok": True, "bf16_vs_fp32": drift}, "float32/padded": {"ok": True}}}


def test_bf16_drift_with_and_without_fp32_sums(summary):
    drift = summary.bf16_drift(_compare(0.333, 0.136), _compare(0.14, 0.136))
    assert drift == {"padded": {"cuda": 0.333, "cuda_fp32_sums": 0.14, "cpu": 0.136}}
    assert summary.bf16_drift(None, None) == {}


def test_tests_passed_reads_the_junit_file(summary, tmp_path):
    xml = tmp_path / "gpu_tests.xml"
    assert not summary.tests_passed(xml, "vector")  # no file: not passed
    case = '<testcase classname="t" name="{}">{}</testcase>'
    body = case.format("test_a[cuda-vector]", "") + case.format("test_b[cuda-scalar]", "<failure/>")
    xml.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    assert summary.tests_passed(xml, "vector") and not summary.tests_passed(xml, "scalar")
    assert not summary.tests_passed(xml, "nothing-by-this-name")
