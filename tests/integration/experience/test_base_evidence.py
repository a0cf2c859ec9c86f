"""base_evidence: PBA's per-prompt correct counts among M base samples, stored once and reused
(experience/methods/pba.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlvr.config import Config
from megatron_rlvr.data import PromptItem
from megatron_rlvr.experience.methods.pba import BaseEvidenceError, base_evidence
from megatron_rlvr.rollout.base import Completion
from megatron_rlvr.rollout.prefixes import PrefixedEngine
from megatron_rlvr.testing.engines import ScriptedEngineBase
from tests.support.eval.fake_engine import FakeEngine

M = 4


class CountingEngine(ScriptedEngineBase):
    """Prompt [c, ...]: its first min(c, n) samples say "yes" (correct), the next "half" (partial credit, not
    correct), the rest "no": the count is min(c, n) by hand."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_token_ids, n, sampling):
        self.calls.append((len(prompt_token_ids), n, sampling.seed))
        return [
            [Completion([1], [], "yes" if j < p[0] else "half" if j == p[0] else "no", "stop") for j in range(n)]
            for p in prompt_token_ids
        ]


class NoCalls(CountingEngine):
    def generate(self, prompt_token_ids, n, sampling):
        raise AssertionError("the engine was called: the stored evidence should have been reused")


class Pool:
    """Reward 1 for a response equal to the reference ("yes"), 0.5 for "half" (not correct: pass@k needs 1)."""

    def __init__(self):
        self.scored = 0

    def score_batch(self, tasks, responses, references):
        self.scored += len(responses)
        return [1.0 if r == a else 0.5 if r == "half" else 0.0 for r, a in zip(responses, references)], {"items": 1}


def _items(correct: list[int]) -> list[PromptItem]:
    return [
        PromptItem(id=f"p{i}", prompt="", prompt_ids=(c, 7, 7), answer="yes", task="fake")
        for i, c in enumerate(correct)
    ]


def _cfg(m: int = M, hf_dir: str = "models/base") -> Config:
    cfg = Config()
    cfg.algo.kl.pba.base_samples = m
    cfg.model.hf_dir = hf_dir
    return cfg


CORRECT = [0, 1, 4, 2, 9, 3, 0]  # 9 > M: all M correct


def test_counts_by_hand_chunked_and_stored(tmp_path):
    engine, pool, path = CountingEngine(), Pool(), tmp_path / "base_evidence.json"
    got = base_evidence(engine, pool, _items(CORRECT), _cfg(), path, run_seed=5, chunk_samples=3 * M)
    want = {f"p{i}": min(c, M) for i, c in enumerate(CORRECT)}
    assert got == want
    assert [(k, n) for k, n, _ in engine.calls] == [(3, M), (3, M), (1, M)]  # chunks of 3 prompts x M samples
    assert len({seed for *_, seed in engine.calls}) == 3 and pool.scored == len(CORRECT) * M
    stored = json.loads(path.read_text())
    assert stored["counts"] == want and stored["samples"] == M and stored["seed"] == 5
    assert stored["model"] == "models/base"
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, renamed


def test_rerun_with_the_file_draws_nothing(tmp_path):
    path = tmp_path / "base_evidence.json"
    first = base_evidence(CountingEngine(), Pool(), _items(CORRECT), _cfg(), path, run_seed=5)
    pool = Pool()
    assert base_evidence(NoCalls(), pool, _items(CORRECT), _cfg(), path, run_seed=5) == first
    assert pool.scored == 0
    # a subset of the stored prompts is served from the file as well
    assert base_evidence(NoCalls(), pool, _items(CORRECT)[:3], _cfg(), path, run_seed=5) == {
        k: first[k] for k in ("p0", "p1", "p2")
    }


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(m=M + 1), "samples"),
        (dict(seed=6), "seed"),
        (dict(hf_dir="models/other"), "model"),
        (dict(temperature=0.7), "sampling"),
    ],
)
def test_a_file_of_another_setting_is_rejected(tmp_path, change, key):
    path = tmp_path / "base_evidence.json"
    base_evidence(CountingEngine(), Pool(), _items(CORRECT), _cfg(), path, run_seed=5)
    cfg = _cfg(m=change.get("m", M), hf_dir=change.get("hf_dir", "models/base"))
    cfg.rollout.temperature = change.get("temperature", cfg.rollout.temperature)
    with pytest.raises(BaseEvidenceError, match=rf"{path}.*another setting.*{key}: file"):
        base_evidence(NoCalls(), Pool(), _items(CORRECT), cfg, path, run_seed=change.get("seed", 5))


def test_an_unreadable_file_is_rejected(tmp_path):
    path = tmp_path / "base_evidence.json"
    path.write_text("{not json")
    with pytest.raises(BaseEvidenceError, match=f"{path}: unreadable"):
        base_evidence(NoCalls(), Pool(), _items(CORRECT), _cfg(), path, run_seed=5)


def test_seeded_and_an_interrupted_draw_resumes_to_the_same_counts(tmp_path):
    items = [PromptItem(id=f"c{i}", prompt="", prompt_ids=(i, 3, 5), answer="1+2", task="fake") for i in range(10)]

    class StartsWith(Pool):
        def score_batch(self, tasks, responses, references):
            return [float(r.startswith(a)) for r, a in zip(responses, references)], {}

    def run(path, engine):
        return base_evidence(engine, StartsWith(), items, _cfg(m=8), path, run_seed=3, chunk_samples=24)

    whole = run(tmp_path / "a.json", FakeEngine())
    assert whole == run(tmp_path / "b.json", FakeEngine())  # seeded: the same counts again
    assert len(set(whole.values())) > 1  # the fake's answers vary, so the comparisons above can fail

    class Crash(FakeEngine):
        def generate(self, prompt_token_ids, n, sampling):
            if self.calls == 2:
                raise KeyboardInterrupt  # interrupted in the third chunk
            return super().generate(prompt_token_ids, n, sampling)

    path = tmp_path / "c.json"
    with pytest.raises(KeyboardInterrupt):
        run(path, Crash())
    assert len(json.loads(path.read_text())["counts"]) == 6  # two chunks of 3 prompts were stored
    resumed = FakeEngine()
    assert run(path, resumed) == whole and resumed.prompts_per_call == [3, 1]  # only the missing chunks


def test_a_prefixed_engine_draws_from_its_target_only(tmp_path):
    target = CountingEngine()
    engine = PrefixedEngine(target, NoCalls(), 0.5, (0.2, 0.8), decode=lambda ids: "")
    got = base_evidence(engine, Pool(), _items(CORRECT), _cfg(), tmp_path / "e.json", run_seed=5)
    assert got == {f"p{i}": min(c, M) for i, c in enumerate(CORRECT)} and target.calls


def _two_ranks(path: str) -> tuple[dict[str, int], list[int]]:
    engine = CountingEngine()
    got = base_evidence(engine, Pool(), _items(CORRECT), _cfg(), Path(path), run_seed=5, chunk_samples=4 * M)
    return got, [k for k, _, _ in engine.calls]


@pytest.mark.dist
def test_two_ranks_share_the_prompts_and_agree(workers2, tmp_path):
    (a, calls_a), (b, calls_b) = workers2.run(_two_ranks, str(tmp_path / "d.json"))
    want = {f"p{i}": min(c, M) for i, c in enumerate(CORRECT)}
    assert a == b == want
    assert calls_a == [2, 2] and calls_b == [2, 1]  # chunks of 4 and 3 prompts, split between the ranks
    assert json.loads((tmp_path / "d.json").read_text())["counts"] == want
