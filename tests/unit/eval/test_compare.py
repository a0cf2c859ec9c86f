"""results.json (per-problem n, c), `eval compare` (paired table, sign test, PNG) and its refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_rlvr.eval.api import evaluate
from megatron_rlvr.eval.bootstrap import IntervalSpec, bootstrap_pass_at_k, paired_difference, sign_test
from megatron_rlvr.eval.command import main as eval_main
from megatron_rlvr.eval.compare import CompareMismatch, check_comparable, compare_runs
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.results import BenchmarkCounts, ResultsError, load_run, results_json, write_results
from megatron_rlvr.eval.store import load_records
from megatron_rlvr.rewards import RewardConfig
from tests.support.eval.fake_engine import FakeEngine, encode, write_data

SETTINGS = {
    "model": "m",
    "seed": 1,
    "chunk": 8,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 24,
    "stop": [],
    "chat_template": False,
    "prompt_format": 1,
    "problems_per_request": 4,
}


@pytest.fixture(scope="module")
def fake_eval(tmp_path_factory):
    """Two fake models evaluated on math500 (3 problems) + countdown (2), n = 16: the run directories."""
    root = tmp_path_factory.mktemp("eval")
    write_data(root / "data")
    out = root / "out"
    cfg = EvalConfig(
        n_samples=16, chunk=8, benchmarks=["math500", "countdown"], data_dir=str(root / "data"), output_dir=str(out)
    )
    skills = {"weak": 0.1, "strong": 0.6}
    ks, rows, _ = evaluate(
        [str(out / "models" / s) for s in skills],
        cfg,
        RewardConfig(workers=1),
        engine_factory=lambda model, c: FakeEngine(skills[Path(model).name]),
        encoder_factory=lambda model, c: encode,
        spec=IntervalSpec(resamples=200),
    )
    return out, ks, rows


def test_results_file_keeps_every_problems_n_and_c(fake_eval):
    out, ks, rows = fake_eval
    for tag in ("weak", "strong"):
        results = json.loads((out / tag / "results.json").read_text())
        records = load_records(out / tag)
        for bench, b in results["benchmarks"].items():
            for pid, n, c in zip(b["problems"], b["n"], b["c"]):
                mine = [r for (bb, p, _), r in records.items() if (bb, p) == (bench, pid)]
                assert n == len(mine) == 16 and c == sum(r["reward"] >= 1.0 for r in mine)
            # every figure recomputes from the file alone
            again = bootstrap_pass_at_k(
                np.array(b["n"]), np.array(b["c"]), ks, IntervalSpec(resamples=200), stream=bench
            )
            assert {str(k): iv.to_json() for k, iv in again.items()} == b["pass_at_k"]
            row = next(r for r in rows if r["model"] == tag and r["benchmark"] == bench)
            assert row["intervals"] == again
        assert results["settings"]["temperature"] == 1.0 and len(results["benchmarks"]["math500"]["digest"]) == 64
        timing = (out / tag / "timing.jsonl").read_text().splitlines()
        assert json.loads(timing[-1])["samples"] == 5 * 16
    assert "[95%]" in (out / "table.md").read_text()


def test_compare_of_run_dirs_and_results_files_gives_the_paired_table_and_png(fake_eval, tmp_path, capsys):
    out, ks, _ = fake_eval
    assert (
        eval_main(
            [
                "compare",
                str(out / "weak"),
                str(out / "strong" / "results.json"),
                "--out",
                str(tmp_path),
                "--resamples",
                "300",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "| benchmark | k | A pass@k [95%] | B pass@k [95%] | B - A [95%, paired] | separated |" in text
    assert (tmp_path / "compare_math500.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "compare.json").read_text())
    a, b = load_run(out / "weak"), load_run(out / "strong")
    for bench in ("math500", "countdown"):
        ca, cb = a.benchmarks[bench], b.benchmarks[bench]
        diff = paired_difference(ca.n, ca.c, cb.n, cb.c, ks, IntervalSpec(resamples=300), stream=bench)
        assert data["benchmarks"][bench]["difference"]["1"] == diff[1].to_json()
        a_only = [p for p, x, y in zip(ca.problem_ids, ca.c, cb.c) if x > 0 and y == 0]
        b_only = [p for p, x, y in zip(ca.problem_ids, ca.c, cb.c) if y > 0 and x == 0]
        assert data["benchmarks"][bench]["a_only"] == a_only and data["benchmarks"][bench]["b_only"] == b_only
        assert data["benchmarks"][bench]["sign_test_p"] == sign_test(len(a_only), len(b_only))
    # a bare run directory (no results.json) reads the same counts from its samples
    (out / "weak" / "results.json").rename(tmp_path / "weak.json")
    try:
        bare = load_run(out / "weak")
        assert bare.benchmarks["math500"].n.tolist() == a.benchmarks["math500"].n.tolist()
        assert bare.benchmarks["math500"].c.tolist() == a.benchmarks["math500"].c.tolist()
    finally:
        (tmp_path / "weak.json").rename(out / "weak" / "results.json")


def _results(
    tmp_path: Path, name: str, settings=None, problems=("p1", "p2", "p3"), n=8, digest="d1", bench="math500"
) -> Path:
    counts = {
        bench: BenchmarkCounts(list(problems), np.full(len(problems), n), np.arange(len(problems)) % (n + 1), digest)
    }
    (tmp_path / name).mkdir()
    return write_results(
        tmp_path / name, results_json("m", {**SETTINGS, **(settings or {})}, counts, [1, 2], IntervalSpec(resamples=50))
    )


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(settings={"temperature": 0.6}), r"the runs differ in temperature \(A: 1.0, B: 0.6\)"),
        (dict(settings={"max_new_tokens": 512}), "the runs differ in max_new_tokens"),
        (dict(settings={"stop": ["\n"]}), "the runs differ in stop"),
        (dict(settings={"chat_template": True}), "the runs differ in chat_template"),
        (
            dict(settings={"system_prompt": "Be brief."}),
            r"the runs differ in system_prompt \(A: None, B: 'Be brief.'\)",
        ),
        (dict(settings={"answer": "last_number"}), r"the runs differ in answer \(A: None, B: 'last_number'\)"),
        (
            dict(problems=("p1", "p2", "p4")),
            r"the runs differ in problems of math500 \(1 only in A: 'p3'; 1 only in B: 'p4'\); compare runs over",
        ),
        (dict(problems=("p1", "p2")), r"the runs differ in problems of math500 \(1 only in A: 'p3'\); compare"),
        (dict(n=16), r"the runs differ in n on math500 \(A: 8 samples per problem, B: 16\)"),
        (dict(digest="d2"), "the runs differ in problems of math500: the same ids with other prompt texts"),
        (dict(bench="aime24"), r"the runs differ in benchmarks \(A: \['math500'\], B: \['aime24'\]\)"),
    ],
)
def test_mismatched_runs_are_refused_naming_the_field(tmp_path, capsys, change, field):
    a = _results(tmp_path, "a")
    b = _results(tmp_path, "b", **change)
    with pytest.raises(CompareMismatch, match=field):
        compare_runs(load_run(a), load_run(b))
    assert eval_main(["compare", str(a), str(b), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: eval compare") and not (tmp_path / "c").exists()


def test_the_eval_seed_may_differ_and_is_said(tmp_path):
    a, b = _results(tmp_path, "a"), _results(tmp_path, "b", settings={"seed": 2})
    check_comparable(load_run(a), load_run(b))  # other draws of the same distribution: comparable


def test_unfinished_and_unknown_inputs_are_named(tmp_path):
    with pytest.raises(ResultsError, match="neither an eval run directory"):
        load_run(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ResultsError, match="not an eval results file"):
        load_run(tmp_path / "x.json")
    a = _results(tmp_path, "a")
    data = json.loads(a.read_text())
    data["benchmarks"]["math500"]["n"][0] = 4  # one problem short: an unfinished run
    a.write_text(json.dumps(data))
    b = _results(tmp_path, "b")
    with pytest.raises(ResultsError, match="hold 4 to 8 samples each; an unfinished run"):
        compare_runs(load_run(a), load_run(b))
