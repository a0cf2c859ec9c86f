"""The eval runner with a deterministic fake engine: tables, kill-and-resume equality, the store's durability."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rlvr.eval import pass_at_k
from megatron_rlvr.eval.benchmarks import load_benchmark
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.runner import EvalRunner, problem_counts, run_settings
from megatron_rlvr.eval.store import RunSettingsMismatch, SampleStore, load_records
from megatron_rlvr.rewards import RewardConfig, RewardPool
from tests.eval.fake_engine import FakeEngine, encode

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_engine.py")


def write_data(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"unique_id": f"p{i}", "problem": f"What is {i} times one, written as a single digit number?", "answer": str(i)}
            for i in (1, 2, 7)]
    (data_dir / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"id": "c0", "numbers": [1, 2, 3], "target": 9}, {"id": "c1", "numbers": [2, 3], "target": 6}]
    (data_dir / "countdown.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_fake_eval(data_dir: Path, out: Path, n: int, chunk: int, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run([sys.executable, str(FAKE), str(data_dir), str(out), str(n), str(chunk)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_table(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    n, chunk = 256, 32
    chunks_total = 2 * 5 * (n // chunk)  # models x problems x chunks

    whole = run_fake_eval(data, tmp_path / "whole", n, chunk)
    assert whole.returncode == 0, whole.stderr[-3000:]

    log = tmp_path / "calls.log"
    killed = run_fake_eval(data, tmp_path / "resumed", n, chunk, {"FAKE_ENGINE_KILL_AT": "30", "FAKE_ENGINE_LOG": str(log)})
    assert killed.returncode == -signal.SIGKILL
    first_calls = len(log.read_text().splitlines())
    assert first_calls == 29
    stored = sum(len(load_records(d)) for d in (tmp_path / "resumed").iterdir() if (d / "samples").is_dir())
    assert 0 < stored < 2 * 5 * n

    resumed = run_fake_eval(data, tmp_path / "resumed", n, chunk, {"FAKE_ENGINE_LOG": str(log)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # nothing repeated: the rerun drew exactly the chunks the killed run had not stored
    assert len(log.read_text().splitlines()) == chunks_total
    assert (tmp_path / "resumed" / "table.csv").read_text() == (tmp_path / "whole" / "table.csv").read_text()
    assert (tmp_path / "resumed" / "table.md").read_text() == (tmp_path / "whole" / "table.md").read_text()
    for tag in ("weak", "strong"):
        lines = [l for s in sorted((tmp_path / "resumed" / tag / "samples").glob("*.jsonl")) for l in s.read_text().splitlines()]
        keys = [(r["benchmark"], r["problem_id"], r["sample"]) for r in map(json.loads, lines)]
        assert len(keys) == len(set(keys)) == 5 * n  # nothing lost, nothing twice
    assert (tmp_path / "resumed" / "passk_math500.png").stat().st_size > 0
    print((tmp_path / "resumed" / "table.md").read_text())


def test_runner_counts_match_a_direct_computation(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("math500", data) + load_benchmark("countdown", data)
    cfg = EvalConfig(n_samples=40, chunk=16)
    engine = FakeEngine(0.5)
    with RewardPool(RewardConfig(workers=1)) as pool:
        EvalRunner(engine, encode, cfg, pool, tmp_path / "run", model="fake").run(problems)
        assert engine.calls == 5 * 3  # chunks of 16, 16, 8
        counts = problem_counts(load_records(tmp_path / "run"), problems, 40)
        # a rerun draws nothing
        EvalRunner(engine, encode, cfg, pool, tmp_path / "run", model="fake").run(problems)
        assert engine.calls == 15
    # recompute rewards for the same seeds by hand
    from megatron_rlvr.eval.runner import chunk_seed
    from megatron_rlvr.rewards import score
    from megatron_rlvr.rollout.base import Sampling

    for problem, c in zip(problems[:3], counts["math500"][1]):
        correct = 0
        for j, size in enumerate((16, 16, 8)):
            seed = chunk_seed(cfg.seed, problem.benchmark, problem.problem_id, j)
            for comp in FakeEngine(0.5).generate([encode(problem.prompt)], size, Sampling(seed=seed))[0]:
                correct += score(problem.task, comp.text, problem.reference) == 1.0
        assert correct == c
    n, c = counts["countdown"]
    assert list(n) == [40, 40] and 0 < c[0] < 40 and 0 < c[1] < 40  # "(1+2)*3" solves c0, "2*3" solves c1


def test_store_ignores_a_cut_off_line_and_refuses_other_settings(tmp_path):
    records = [{"benchmark": "b", "problem_id": "p", "sample": s, "chunk": 0, "reward": 1.0, "text": "x"} for s in range(3)]
    with SampleStore(tmp_path, {"seed": 1}) as store:
        store.append(records[:2])
        store.append(records[:2])  # already stored: not written twice
    shard = next((tmp_path / "samples").glob("shard-*.jsonl"))
    with open(shard, "a") as f:
        f.write('{"benchmark": "b", "problem_id": "p", "sam')  # a write cut off by SIGKILL
    assert sorted(load_records(tmp_path)) == [("b", "p", 0), ("b", "p", 1)]
    with SampleStore(tmp_path, {"seed": 1}) as store:
        store.append(records)
    assert sorted(load_records(tmp_path)) == [("b", "p", 0), ("b", "p", 1), ("b", "p", 2)]
    assert len(list((tmp_path / "samples").glob("shard-*.jsonl"))) == 2  # a resumed run writes a fresh shard
    with pytest.raises(RunSettingsMismatch, match="seed: stored 1, now 2"):
        SampleStore(tmp_path, {"seed": 2})
    with SampleStore(tmp_path, {"seed": 1}):
        with pytest.raises(RuntimeError, match="another eval run"):
            SampleStore(tmp_path, {"seed": 1})


def test_table_rows_are_mean_pass_at_k(tmp_path):
    from megatron_rlvr.eval.report import k_values, markdown_table, pass_at_k_rows, write_reports

    assert k_values(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert k_values(40) == [1, 2, 4, 8, 16, 32, 40]
    counts = {"m": {"b": (np.array([8, 8]), np.array([0, 4]))}}
    ks, rows = pass_at_k_rows(counts)
    assert rows[0]["pass"][1] == pytest.approx(0.25)
    assert rows[0]["pass"][4] == pytest.approx((pass_at_k(8, 0, 4) + pass_at_k(8, 4, 4)) / 2)
    assert "| b | m | 2 | 8 | 25.0 |" in markdown_table(ks, rows)
    paths = write_reports(ks, rows, tmp_path)
    assert [p.name for p in paths] == ["table.md", "table.csv", "passk_b.png"]


class RecordingEngine(FakeEngine):
    def __init__(self):
        super().__init__(0.5)
        self.seeds = []

    def generate(self, prompt_token_ids, n, sampling):
        self.seeds.append((sampling.seed, n))
        return super().generate(prompt_token_ids, n, sampling)


def test_follower_ranks_draw_rank_zeros_plan_and_write_nothing(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("countdown", data)
    cfg = EvalConfig(n_samples=20, chunk=8)
    plans = []

    def capture(plan):
        plans.append(plan)
        return plan

    leader = RecordingEngine()
    with RewardPool(RewardConfig(workers=1)) as pool:
        with SampleStore(tmp_path / "run", run_settings(cfg, "m")) as store:
            store.append([{"benchmark": "countdown", "problem_id": "c0", "sample": s, "chunk": 0, "reward": 0.0} for s in range(8)])
        EvalRunner(leader, encode, cfg, pool, tmp_path / "run", model="m", broadcast=capture).run(problems)
    assert plans == [[(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]]  # c0's first chunk was already stored

    follower = RecordingEngine()
    EvalRunner(follower, encode, cfg, None, tmp_path / "follower", model="m", rank=1, broadcast=lambda _: plans[0]).run(problems)
    assert follower.seeds == leader.seeds and not (tmp_path / "follower").exists()
    with pytest.raises(ValueError, match="needs a RewardPool"):
        EvalRunner(follower, encode, cfg, None, tmp_path / "x", model="m")
