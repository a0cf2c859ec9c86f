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
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.runner import EvalRunner, problem_counts
from megatron_rlvr.eval.store import RunSettingsMismatch, SampleStore, load_records
from megatron_rlvr.problems.benchmarks import load_benchmark
from megatron_rlvr.rewards import RewardConfig, RewardPool
from tests.support.eval import fake_engine
from tests.support.eval.fake_engine import FakeEngine, encode, write_data

REPO = Path(__file__).resolve().parents[3]
FAKE = Path(fake_engine.__file__)


def run_fake_eval(
    data_dir: Path, out: Path, n: int, chunk: int, request_samples: int, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, str(FAKE), str(data_dir), str(out), str(n), str(chunk), str(request_samples)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


BLOCKS = {
    ("math500", "p1"): 0,
    ("math500", "p2"): 0,
    ("math500", "p7"): 1,
    ("countdown", "c0"): 0,
    ("countdown", "c1"): 0,
}


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_table(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    n, chunk, request_samples = 256, 32, 64  # 2 problems per request: math500 in blocks {p1, p2}, {p7}
    requests_total = 2 * 3 * (n // chunk)  # models x blocks x chunks

    whole = run_fake_eval(data, tmp_path / "whole", n, chunk, request_samples)
    assert whole.returncode == 0, whole.stderr[-3000:]

    log = tmp_path / "calls.log"
    killed = run_fake_eval(
        data,
        tmp_path / "resumed",
        n,
        chunk,
        request_samples,
        {"FAKE_ENGINE_KILL_AT": "20", "FAKE_ENGINE_LOG": str(log)},
    )
    assert killed.returncode == -signal.SIGKILL
    first_calls = len(log.read_text().splitlines())
    assert first_calls == 19  # the engine of the first model (each model gets its own)
    records = {tag: load_records(tmp_path / "resumed" / tag) for tag in ("weak", "strong")}
    stored = sum(len(r) for r in records.values())
    assert 0 < stored < 2 * 5 * n
    # a request's samples go out in one write: stored requests are whole
    stored_requests = {
        (tag, b, BLOCKS[(b, p)], r["chunk"]) for tag, recs in records.items() for (b, p, _), r in recs.items()
    }
    assert stored == sum(2 if (b, blk) != ("math500", 1) else 1 for _, b, blk, _ in stored_requests) * chunk
    # scoring runs beside the next draw: the request drawn just before the kill may not be stored yet
    assert first_calls - 1 <= len(stored_requests) <= first_calls

    resumed = run_fake_eval(data, tmp_path / "resumed", n, chunk, request_samples, {"FAKE_ENGINE_LOG": str(log)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # nothing repeated: the rerun drew exactly the requests the killed run had not stored
    assert len(log.read_text().splitlines()) - first_calls == requests_total - len(stored_requests)
    assert (tmp_path / "resumed" / "table.csv").read_text() == (tmp_path / "whole" / "table.csv").read_text()
    assert (tmp_path / "resumed" / "table.md").read_text() == (tmp_path / "whole" / "table.md").read_text()
    for tag in ("weak", "strong"):  # per-problem (n, c) and intervals: the same as an uninterrupted run's
        results = [json.loads((tmp_path / run / tag / "results.json").read_text()) for run in ("resumed", "whole")]
        for r in results:  # the model directories differ (each run has its own); nothing else may
            del r["model"], r["settings"]["model"]
        assert results[0] == results[1]
    for tag in ("weak", "strong"):
        lines = [
            line
            for s in sorted((tmp_path / "resumed" / tag / "samples").glob("*.jsonl"))
            for line in s.read_text().splitlines()
        ]
        keys = [(r["benchmark"], r["problem_id"], r["sample"]) for r in map(json.loads, lines)]
        assert len(keys) == len(set(keys)) == 5 * n  # nothing lost, nothing twice

        def texts(d):
            return {k: r["text"] for k, r in load_records(d).items()}

        assert texts(tmp_path / "resumed" / tag) == texts(tmp_path / "whole" / tag)  # the very same samples
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
        # one request per (benchmark, chunk of 16, 16, 8): every problem of a benchmark in the same call
        assert engine.calls == 2 * 3 and sorted(set(engine.prompts_per_call)) == [2, 3]
        counts = problem_counts(load_records(tmp_path / "run"), problems, 40)
        # a rerun draws nothing
        EvalRunner(engine, encode, cfg, pool, tmp_path / "run", model="fake").run(problems)
        assert engine.calls == 6
    # recompute rewards for the same seeds by hand
    from megatron_rlvr.eval.runner import request_seed
    from megatron_rlvr.rewards import score
    from megatron_rlvr.rollout.base import Sampling

    math = problems[:3]
    for position, (problem, c) in enumerate(zip(math, counts["math500"][1])):
        correct = 0
        for j, size in enumerate((16, 16, 8)):
            seed = request_seed(cfg.seed, "math500", 0, j)
            drawn = FakeEngine(0.5).generate([encode(p.prompt) for p in math], size, Sampling(seed=seed))[position]
            correct += sum(score(problem.task, comp.text, problem.reference) == 1.0 for comp in drawn)
        assert correct == c
    n, c = counts["countdown"]
    assert list(n) == [40, 40] and 0 < c[0] < 40 and 0 < c[1] < 40  # "(1+2)*3" solves c0, "2*3" solves c1


def test_store_ignores_a_cut_off_line_and_refuses_other_settings(tmp_path):
    records = [
        {"benchmark": "b", "problem_id": "p", "sample": s, "chunk": 0, "reward": 1.0, "text": "x"} for s in range(3)
    ]
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
    with SampleStore(tmp_path, {"seed": 1}), pytest.raises(RuntimeError, match="another eval run"):
        SampleStore(tmp_path, {"seed": 1})


def test_table_rows_are_mean_pass_at_k(tmp_path):
    from megatron_rlvr.eval.report import k_values, markdown_table, pass_at_k_rows, write_reports

    assert k_values(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert k_values(40) == [1, 2, 4, 8, 16, 32, 40]
    counts = {"m": {"b": (np.array([8, 8]), np.array([0, 4]))}}
    ks, rows = pass_at_k_rows(counts)
    assert rows[0]["pass"][1] == pytest.approx(0.25)
    assert rows[0]["pass"][4] == pytest.approx((pass_at_k(8, 0, 4) + pass_at_k(8, 4, 4)) / 2)
    # two problems at pass@1 0 and 1/2: resampled means 0, 1/4, 1/2 with chances 1/4, 1/2, 1/4 -> [0, 50]
    assert "| b | m | 2 | 8 | 25.0 [0.0, 50.0] |" in markdown_table(ks, rows)
    paths = write_reports(ks, rows, tmp_path)
    assert [p.name for p in paths] == ["table.md", "table.csv", "passk_b.png"]
    header, row = (tmp_path / "table.csv").read_text().splitlines()
    assert header.split(",")[4:7] == ["pass@1", "pass@1_low", "pass@1_high"]
    assert [float(x) for x in row.split(",")[4:7]] == [0.25, 0.0, 0.5]


class RecordingEngine(FakeEngine):
    def __init__(self):
        super().__init__(0.5)
        self.seeds = []

    def generate(self, prompt_token_ids, n, sampling):
        self.seeds.append((sampling.seed, n, len(prompt_token_ids)))
        return super().generate(prompt_token_ids, n, sampling)


def texts_of(run_dir: Path) -> dict:
    return {key: (r["text"], r["reward"]) for key, r in load_records(run_dir).items()}


def test_a_resumed_request_draws_a_prefix_of_its_block_with_the_same_samples(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("math500", data)
    cfg = EvalConfig(n_samples=20, chunk=8)
    with RewardPool(RewardConfig(workers=1)) as pool:
        EvalRunner(FakeEngine(0.5), encode, cfg, pool, tmp_path / "whole", model="m").run(problems)
        # a run cut to the first problem (--limit 1), then resumed with all three
        EvalRunner(FakeEngine(0.5), encode, cfg, pool, tmp_path / "grown", model="m").run(problems[:1])
        engine = RecordingEngine()
        plans = []
        EvalRunner(
            engine, encode, cfg, pool, tmp_path / "grown", model="m", broadcast=lambda plan: plans.append(plan) or plan
        ).run(problems)
    # each chunk's request draws the whole block again (problem 0 at position 0), keeping only the new samples
    assert [len(r.problems) for r in plans[0]] == [3, 3, 3] and [len(r.stored) for r in plans[0]] == [8, 8, 4]
    assert texts_of(tmp_path / "grown") == texts_of(tmp_path / "whole")


def test_replicas_split_the_requests_and_together_store_what_one_engine_does(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("math500", data) + load_benchmark("countdown", data)
    cfg = EvalConfig(n_samples=24, chunk=8, request_samples=16)  # 2 problems per request: 3 blocks x 3 chunks
    with RewardPool(RewardConfig(workers=1)) as pool:
        single = RecordingEngine()
        EvalRunner(single, encode, cfg, pool, tmp_path / "one", model="m").run(problems)
        plans = []
        # world of 4 ranks, engines of TP=2: replica 0 = ranks 0, 1; replica 1 = ranks 2, 3 (sequential stand-ins
        # for the ranks: rank 0 plans and broadcasts, the others receive its plan)
        engines = {r: RecordingEngine() for r in range(4)}
        EvalRunner(
            engines[0],
            encode,
            cfg,
            pool,
            tmp_path / "four",
            model="m",
            world=4,
            tp=2,
            broadcast=lambda plan: plans.append(plan) or plan,
        ).run(problems)

        def receive(_):
            return plans[0]

        EvalRunner(
            engines[1], encode, cfg, None, tmp_path / "four", model="m", rank=1, world=4, tp=2, broadcast=receive
        ).run(problems)
        EvalRunner(
            engines[2], encode, cfg, pool, tmp_path / "four", model="m", rank=2, world=4, tp=2, broadcast=receive
        ).run(problems)
        EvalRunner(
            engines[3], encode, cfg, None, tmp_path / "four", model="m", rank=3, world=4, tp=2, broadcast=receive
        ).run(problems)
    assert len(plans[0]) == 9
    assert engines[0].seeds == engines[1].seeds and engines[2].seeds == engines[3].seeds  # TP ranks in lockstep
    assert len(engines[0].seeds) == 5 and len(engines[2].seeds) == 4  # requests 0, 2, 4, ... and 1, 3, ...
    assert sorted(engines[0].seeds + engines[2].seeds) == sorted(single.seeds)
    shards = sorted(p.name for p in (tmp_path / "four" / "samples").glob("*.jsonl"))
    assert shards == ["shard-00000-r2.jsonl", "shard-00000.jsonl"] or shards == [
        "shard-00000.jsonl",
        "shard-00001-r2.jsonl",
    ]
    assert texts_of(tmp_path / "four") == texts_of(tmp_path / "one")
    with pytest.raises(ValueError, match="needs a RewardPool"):
        EvalRunner(engines[2], encode, cfg, None, tmp_path / "x", model="m", rank=2, world=4, tp=2)


class SlowScorePool:
    """Scores nothing until the engine has started the next request: only a scorer beside the engine finishes."""

    def __init__(self, events):
        self.events = events
        self.overlapped = []

    def score_batch(self, tasks, responses, references):
        self.overlapped.append(self.events["next_draw"].wait(timeout=20))
        return [0.0] * len(tasks), {"items": len(tasks)}


def test_requests_are_scored_while_the_engine_draws_the_next(tmp_path):
    import threading

    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("countdown", data)
    events = {"next_draw": threading.Event()}

    class Engine(FakeEngine):
        def generate(self, prompt_token_ids, n, sampling):
            if self.calls == 1:
                events["next_draw"].set()  # the second draw started
            return super().generate(prompt_token_ids, n, sampling)

    pool = SlowScorePool(events)
    EvalRunner(Engine(), encode, EvalConfig(n_samples=16, chunk=8), pool, tmp_path / "run", model="m").run(problems)
    assert pool.overlapped[0] is True and len(load_records(tmp_path / "run")) == 2 * 16


@pytest.mark.slow
def test_two_engine_replicas_under_torchrun_store_what_one_process_does(tmp_path):
    data = tmp_path / "data"
    write_data(data)
    n, chunk, request_samples = 48, 16, 32  # 2 problems per request: 3 blocks x 3 chunks per model
    single = run_fake_eval(data, tmp_path / "one", n, chunk, request_samples)
    assert single.returncode == 0, single.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(FAKE),
            str(data),
            str(tmp_path / "two"),
            str(n),
            str(chunk),
            str(request_samples),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    for tag in ("weak", "strong"):
        shards = sorted(p.name for p in (tmp_path / "two" / tag / "samples").glob("*.jsonl"))
        assert len(shards) == 2 and any(name.endswith("-r1.jsonl") for name in shards)  # each replica wrote its share
        assert texts_of(tmp_path / "two" / tag) == texts_of(tmp_path / "one" / tag)
    assert (tmp_path / "two" / "table.csv").read_text() == (tmp_path / "one" / "table.csv").read_text()


def test_the_progress_bar_names_the_model_by_its_label(tmp_path, capsys):
    data = tmp_path / "data"
    write_data(data)
    problems = load_benchmark("math500", data)
    with RewardPool(RewardConfig(workers=1)) as pool:
        runner = EvalRunner(
            FakeEngine(0.5), encode, EvalConfig(n_samples=2, chunk=2), pool, tmp_path / "r", model="a/hf"
        )
        assert runner.label == "hf"  # the directory's name without a label
        EvalRunner(
            FakeEngine(0.5), encode, EvalConfig(n_samples=2, chunk=2), pool, tmp_path / "r", model="a/hf", label="a-hf"
        ).run(problems)
    assert "eval a-hf" in capsys.readouterr().err
