"""The fixed probe on a tiny model, end to end against a dense float64 computation: the probe set's batch, the
megatron scorer at TP = 2 (vocabulary padded in the last shard) and at DP = 2, an HF directory and a dist checkpoint
of the same weights, the per-prompt summary (all and forking positions, rare responses), the results file and the
figure; the probe draw with a scripted engine (rows, rare answers, forking positions, resume without an engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_rlvr.inspection import probe_set as ps
from megatron_rlvr.inspection.probe_summary import RANK3_THRESHOLD, statistic_names, summarize

KS = (4, 16)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    # vocab 1000: padded to 1024 at TP = 2, so the last shard holds 24 padded ids
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), seed=5, rope_scaling=None))


def _probe_set() -> ps.ProbeSet:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=g).tolist()

    prompts = [ps.ProbePrompt(f"p{i}", f"prompt {i}", ids(5 + 2 * i), 16, c) for i, c in enumerate((0, 2, 9))]
    rows = [
        ps.ProbeRow(0, 0, ids(7), 0.0, True, False, [1, 4]),
        ps.ProbeRow(0, 1, ids(3), 0.0, True, False, [0]),
        ps.ProbeRow(1, 0, ids(9), 0.0, True, False, [2, 3, 8]),
        ps.ProbeRow(1, 5, ids(6), 1.0, False, True),  # a rare correct answer outside the probe rows
        ps.ProbeRow(1, 1, ids(4), 1.0, True, True, [1]),  # both
        ps.ProbeRow(2, 0, ids(11), 1.0, True, False, [0, 10]),
    ]
    return ps.ProbeSet("tiny", {"n": 16}, prompts, rows)


def _dense(hf_dir: str, probe_set: ps.ProbeSet) -> list[dict[str, np.ndarray]]:
    """Per row, every statistic at its response positions from transformers' logits in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    out = []
    for row in probe_set.rows:
        prompt = probe_set.prompts[row.prompt].prompt_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + row.ids])).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        p = logp.exp()
        top = p.sort(dim=-1, descending=True).values[:, :3]
        out.append(
            {
                "logp": logp.gather(1, torch.tensor(row.ids)[:, None])[:, 0].numpy(),
                "entropy": (-(p * logp).sum(-1)).numpy(),
                "rank1": top[:, 0].numpy(),
                "rank2": top[:, 1].numpy(),
                "rank3": top[:, 2].numpy(),
                **{f"distinct@{k}": (1 - (1 - p) ** k).sum(-1).numpy() for k in KS},
            }
        )
    return out


def _score_in_worker(checkpoints: list[str], probe_set: ps.ProbeSet, tp: int) -> list[torch.Tensor]:
    from megatron_rlvr.inspection.probe_scoring import ProbeScorer

    with ProbeScorer(checkpoints[0], tp=tp, ks=KS, max_tokens_per_micro_batch=40) as scorer:
        out = []
        for checkpoint in checkpoints:
            scorer.load(checkpoint)
            out.append(scorer.score(probe_set.batch(pad_id=0)))
    return out


@pytest.fixture(scope="module")
def dist_checkpoint(tiny_llama, tmp_path_factory):
    from megatron_rlvr.bridge.convert import hf_to_mcore

    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    hf_to_mcore(tiny_llama, out)
    return str(out)


@pytest.fixture(scope="module")
def scored(workers2, tiny_llama, dist_checkpoint):
    """(probe set, dense reference, {layout: [values per checkpoint] of rank 0 and rank 1})."""
    probe_set = _probe_set()
    runs = {
        "tp2": workers2.run(_score_in_worker, [tiny_llama, dist_checkpoint], probe_set, 2),
        "dp2": workers2.run(_score_in_worker, [tiny_llama], probe_set, 1),
    }
    return probe_set, _dense(tiny_llama, probe_set), runs


@pytest.mark.dist
@pytest.mark.slow  # the shared fixture scores at two layouts in a worker group: ~20 s on 2 cores
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_every_statistic_at_every_response_position_equals_float64(scored, layout):
    from megatron_rlvr.inspection.probe_stats import field_names

    probe_set, dense, runs = scored
    rank0, rank1 = runs[layout]
    for values in (*rank0, *rank1):
        assert torch.equal(values, rank0[0])  # every rank the same; the dist checkpoint gives the HF weights' numbers
    values = rank0[0]
    worst = {}
    for r, row in enumerate(probe_set.rows):
        start = len(probe_set.prompts[row.prompt].prompt_ids) - 1
        for f, name in enumerate(field_names(KS)):
            got = values[r, f, start : start + len(row.ids)].double().numpy()
            want = dense[r][name]
            scale = np.maximum(np.abs(want), 1.0)
            worst[name] = max(worst.get(name, 0.0), float((np.abs(got - want) / scale).max()))
    print(
        f"{layout}: max |float32 probe - float64 dense| / max(|value|, 1): "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    assert all(v < 2e-5 for v in worst.values()), worst


@pytest.mark.dist
@pytest.mark.slow
def test_the_summary_sums_each_prompts_positions_and_its_forking_ones(scored, tmp_path):
    from megatron_rlvr.inspection.mechanism_stats import prompt_interval, rare_logp, statistic
    from megatron_rlvr.inspection.probe_figure import render
    from megatron_rlvr.inspection.probe_summary import load_scores, scores_json, write_scores

    probe_set, dense, runs = scored
    summary = summarize(probe_set, runs["tp2"][0][0], KS)
    assert set(summary["sums"]["all"]) == set(statistic_names(KS))
    for scope in ("all", "forking"):
        for i in range(len(probe_set.prompts)):
            rows = [(r, row) for r, row in enumerate(probe_set.rows) if row.prompt == i and row.probe]
            pick = [slice(None) if scope == "all" else row.forking for _, row in rows]
            count = sum(len(dense[r]["rank1"][w]) for (r, _), w in zip(rows, pick))
            assert summary["counts"][scope][i] == count
            rank3 = np.concatenate([dense[r]["rank3"][w] for (r, _), w in zip(rows, pick)])
            p12 = [np.concatenate([dense[r][k][w] for (r, _), w in zip(rows, pick)]) for k in ("rank1", "rank2")]
            sums = summary["sums"][scope]
            assert sums["rank3_below"][i] == float((rank3 < RANK3_THRESHOLD).sum())
            assert sums["gap"][i] == pytest.approx(float((p12[0] - p12[1]).sum()), abs=1e-4)
            assert sums["top3"][i] == pytest.approx(float((p12[0] + p12[1] + rank3).sum()), abs=1e-4)
    rare = [(r, row) for r, row in enumerate(probe_set.rows) if row.rare]
    assert [(x["prompt"], x["sample"], x["tokens"]) for x in summary["rare"]] == [
        (row.prompt, row.sample, len(row.ids)) for _, row in rare
    ]
    rank1 = np.concatenate([dense[r]["rank1"] for r, row in enumerate(probe_set.rows) if row.probe])
    assert summary["by_rank1"]["count"] == np.bincount((rank1 * 20).astype(int), minlength=20).tolist()
    assert sum(summary["by_rank1"]["count"]) == sum(summary["counts"]["all"])
    for x, (r, _) in zip(summary["rare"], rare):
        assert x["logp"] == pytest.approx(float(dense[r]["logp"].sum()), abs=1e-4)
    # the results file round-trips, its pooled mean is the interval's estimate, and the figure draws
    path = write_scores(tmp_path / "s.json", scores_json("tiny", "ckpt", probe_set, summary, {"ks": list(KS)}))
    data = load_scores(path)
    iv = prompt_interval(statistic(data, "all", "entropy"), len(probe_set.prompts))
    assert iv.estimate == pytest.approx(summary["means"]["all"]["entropy"])
    assert iv.low <= iv.estimate <= iv.high
    assert prompt_interval(rare_logp(data), 3).estimate == pytest.approx(summary["means"]["rare"]["logp"])
    assert render([data, data | {"label": "again"}], tmp_path / "fig.png").stat().st_size > 10_000


def test_the_batch_marks_exactly_the_response_positions():
    probe_set = _probe_set()
    batch = probe_set.batch(pad_id=0)
    for b, row in enumerate(probe_set.rows):
        prompt = probe_set.prompts[row.prompt].prompt_ids
        positions = batch.response_mask[b].nonzero().flatten()
        assert positions.tolist() == list(range(len(prompt) - 1, len(prompt) - 1 + len(row.ids)))
        assert batch.tokens[b, positions + 1].tolist() == row.ids  # position t scores token t + 1


def test_probe_set_files_round_trip_and_bad_ones_are_one_line(tmp_path):
    probe_set = _probe_set()
    path = probe_set.save(tmp_path / "p.json")
    again = ps.load(path)
    assert again == probe_set and again.digest() == probe_set.digest()
    data = json.loads(path.read_text())
    data["rows"][0]["ids"][0] += 1
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(ps.ProbeSetError, match="does not match its digest"):
        ps.load(tmp_path / "edited.json")
    with pytest.raises(ps.ProbeSetError, match="no such probe set"):
        ps.load(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"format": "x"}')
    with pytest.raises(ps.ProbeSetError, match="not a probe set"):
        ps.load(tmp_path / "other.json")
    del data["digest"]
    data["rows"][0]["forking"] = [99]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ps.ProbeSetError, match=r"rows\[0\].forking"):
        ps.load(tmp_path / "bad.json")


class _ScriptedEngine:
    """Sample s of prompt j answers ``answers[j][s]`` (text and byte ids); counts its generate calls."""

    def __init__(self, tokenizer, answers: dict[str, list[str]]):
        self.tokenizer, self.answers, self.calls, self.closed = tokenizer, answers, 0, False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_token_ids, n, sampling):
        from megatron_rlvr.rollout.base import Completion

        self.calls += 1
        out = []
        for ids in prompt_token_ids:
            texts = self.answers[self.tokenizer.decode(ids)]
            out.append([Completion(self.encode(t), [], t, "stop") for t in texts[:n]])
        return out

    def close(self):
        self.closed = True


def test_draw_keeps_the_first_samples_and_the_rare_correct_ones_and_resumes(tiny_llama, tmp_path):
    from megatron_rlvr.inspection.probe_draw import DrawSettings, draw

    rows = [("p0", "1 + 1", "2"), ("p1", "2 + 2", "4"), ("p2", "3 + 3", "6")]
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "reasoning_gym.jsonl", "w") as f:
        for pid, problem, answer in rows:
            meta = {"source_dataset": "basic_arithmetic", "source_index": 0, "expression": problem}
            entry = {"answer": answer, "metadata": meta}
            row = {"id": pid, "problem": problem, "answer": entry, "task": "reasoning_gym:basic_arithmetic"}
            f.write(json.dumps(row) + "\n")
    # p0: never right; p1: right in samples 3 and 5 (rare); p2: right in 6 of 8 (not rare)
    answers = {
        "1 + 1": ["it is 3"] * 8,
        "2 + 2": ["it is 5", "it is 5", "it is 5", "it is 4", "it is 7", "so 4", "it is 1", "it is 0"],
        "3 + 3": ["6", "6", "5", "6", "6", "6", "1", "6"],
    }
    from transformers import AutoTokenizer

    engine = _ScriptedEngine(AutoTokenizer.from_pretrained(tiny_llama), answers)
    settings = DrawSettings(
        data_dir=str(tmp_path / "data"), limit=3, n=8, keep=2, rare_max=2, block_prompts=2, chat_template=False
    )
    probe_set = draw(tiny_llama, settings, tmp_path / "probe.json", engine_factory=lambda model, cfg: engine)
    assert engine.calls == 2 and engine.closed  # two blocks, one request each
    assert [(p.id, p.correct) for p in probe_set.prompts] == [("p0", 0), ("p1", 2), ("p2", 6)]
    got = [(r.prompt, r.sample, r.probe, r.rare) for r in probe_set.rows]
    assert got == [
        (0, 0, True, False),
        (0, 1, True, False),
        (1, 0, True, False),
        (1, 1, True, False),
        (1, 3, False, True),
        (1, 5, False, True),
        (2, 0, True, False),
        (2, 1, True, False),
    ]
    assert probe_set.rows[4].ids == engine.encode("it is 4")
    for row in probe_set.rows:  # the top 20% entropy of each probe response (a 1-token one has none), none elsewhere
        assert (len(row.forking) > 0) == (row.probe and len(row.ids) > 1)
        assert len(row.forking) <= max(1, round(0.2 * len(row.ids)) + 1)

    def no_engine(model, cfg):
        raise AssertionError("a complete draw starts no engine")

    (tmp_path / "probe.json").unlink()  # killed after the last block: the rerun draws nothing again
    again = draw(tiny_llama, settings, tmp_path / "probe.json", engine_factory=no_engine)
    assert again.digest() == probe_set.digest()
    bigger = DrawSettings(**{**settings.__dict__, "n": 4})
    with pytest.raises(ps.ProbeSetError, match="other settings"):
        draw(tiny_llama, bigger, tmp_path / "probe.json", engine_factory=no_engine)


def test_the_command_line_says_bad_input_in_one_line(tmp_path, tiny_llama, capsys):
    from megatron_rlvr.cli import main

    probe_path = _probe_set().save(tmp_path / "p.json")
    cases = [
        (
            ["--probe-set", str(tmp_path / "none.json"), "--checkpoint", tiny_llama],
            f"error: {tmp_path / 'none.json'}: no such",
        ),
        (["--probe-set", str(probe_path), "--checkpoint", str(tmp_path)], f"error: {tmp_path}: neither an HF model"),
        (["--probe-set", str(probe_path), "--checkpoint", tiny_llama, "--ks", "0"], "error: --ks: ks: expected"),
        (["--probe-set", str(probe_path), "--checkpoint", tiny_llama, "--tp", "3"], "error: actor.tp=3 must divide"),
    ]
    for args, start in cases:
        capsys.readouterr()
        assert main(["probe", "score", *args, "--out", str(tmp_path / "out")]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(start), lines
