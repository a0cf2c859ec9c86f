"""Candidate matrices: the op's top-N order (ties to the lower id, padding ids excluded), deterministic sampling, the
heatmap and JSON of `megatron-rlvr candidates`, benchmark rows, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.demo import MODEL_DIR
from megatron_rlvr.errors import UserError
from megatron_rlvr.inspection import candidates as cand

PROMPT = "9 7 6 9 -> 18:"


@pytest.fixture(scope="module")
def demo():
    return cand.load_model(MODEL_DIR)


class _FixedLogits:
    """A model whose next-token logits are given per position (shape [T, V]), for exact expectations."""

    def __init__(self, rows, vocab_size):
        self.rows = torch.tensor(rows, dtype=torch.float32)
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=64)

    def __call__(self, input_ids, **_):
        seq = input_ids.shape[1]
        logits = torch.zeros(1, seq, self.rows.shape[1])
        logits[0, seq - self.rows.shape[0] - 1 : seq - 1] = self.rows
        return SimpleNamespace(logits=logits)


def test_top_n_is_sorted_with_ties_to_the_lower_id_and_padding_ids_excluded(demo):
    _, tokenizer = demo
    # vocab 6 of 8 columns: ids 6 and 7 are padding (largest logits, yet never candidates); ids 1, 3, 4 tie
    rows = [[0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 9.0, 9.0], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 9.0]]
    model = _FixedLogits(rows, vocab_size=6)
    m = cand.candidate_matrix(model, tokenizer, [5, 6, 7], [4, 5], top_n=4, label="fixed")
    probs = torch.softmax(torch.tensor(rows)[:, :6], -1)
    first, second = m.tokens
    assert [c["id"] for c in first.candidates] == [1, 3, 4, 2]
    assert [c["id"] for c in second.candidates] == [0, 1, 2, 3]
    for t, tok in enumerate(m.tokens):
        assert [c["prob"] for c in tok.candidates] == pytest.approx(
            probs[t, [c["id"] for c in tok.candidates]].tolist()
        )
    assert first.rank == 3 and first.prob == pytest.approx(float(probs[0, 4]))
    assert second.rank is None and second.prob == pytest.approx(float(probs[1, 5]))  # outside the top 4
    assert first.entropy == pytest.approx(float(-(probs[0] * probs[0].log()).sum()), rel=1e-5)
    assert first.text == tokenizer.decode([4])


def test_sampling_is_deterministic_per_seed_and_stops_before_the_stop_string(demo):
    model, tokenizer = demo
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    draws = {
        seed: cand.sample_response(
            model, tokenizer, prompt_ids, max_new_tokens=24, temperature=1.0, seed=seed, stop=["\n"]
        )
        for seed in range(4)
    }
    again = cand.sample_response(model, tokenizer, prompt_ids, max_new_tokens=24, temperature=1.0, seed=2, stop=["\n"])
    assert again == draws[2]
    assert len({tuple(r) for r in draws.values()}) > 1  # the seed matters
    for response in draws.values():
        assert "\n" not in tokenizer.decode(response) and tokenizer.eos_token_id not in response


def test_cli_renders_models_side_by_side_and_writes_the_numbers(tmp_path, demo):
    model, _ = demo
    other = tmp_path / "other"
    shutil.copytree(MODEL_DIR, other)
    changed = type(model).from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        changed.lm_head.weight.mul_(3.0)  # sharper: same tokens, other probabilities
    changed.save_pretrained(other)
    png, out_json = tmp_path / "c.png", tmp_path / "c.json"
    rc = cand.main(
        [
            "--model",
            MODEL_DIR,
            str(other),
            "--label",
            "base",
            "sharp",
            "--prompt",
            PROMPT,
            "--response",
            "9+9*(7-6)",
            "--top-n",
            "3",
            "--out",
            str(png),
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out_json.read_text())
    assert data["response"] == "9+9*(7-6)" and data["sampled"] is False
    base, sharp = data["models"]
    assert [b["label"] for b in data["models"]] == ["base", "sharp"]
    assert [t["id"] for t in base["tokens"]] == [t["id"] for t in sharp["tokens"]] == data["response_ids"]
    assert all(len(t["candidates"]) == 3 for t in base["tokens"])
    top1 = [(t["candidates"][0]["prob"], s["candidates"][0]["prob"]) for t, s in zip(base["tokens"], sharp["tokens"])]
    assert all(s >= b - 1e-6 for b, s in top1) and any(s > b + 0.05 for b, s in top1)
    for tok in base["tokens"]:
        probs = [c["prob"] for c in tok["candidates"]]
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6 and math.isfinite(tok["entropy"])


def test_sampled_response_with_seed_is_repeatable_through_the_cli(tmp_path):
    outs = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        cand.main(
            [
                "--model",
                MODEL_DIR,
                "--prompt",
                PROMPT,
                "--stop",
                "\n",
                "--seed",
                "5",
                "--out",
                str(tmp_path / f"r{i}.png"),
                "--json",
                str(path),
            ]
        )
        outs.append(json.loads(path.read_text()))
    assert outs[0]["response_ids"] == outs[1]["response_ids"] and outs[0]["seed"] == 5 and outs[0]["sampled"]


def test_benchmark_row_gives_the_eval_prompt(tmp_path):
    rows = [{"id": "a", "numbers": [1, 2, 3, 4], "target": 10}, {"id": "b", "numbers": [9, 7, 6, 9], "target": 18}]
    (tmp_path / "countdown.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from megatron_rlvr.problems.benchmarks import load_benchmark

    expected = load_benchmark("countdown", tmp_path)[1].prompt
    assert cand.benchmark_prompt(str(tmp_path / "countdown.jsonl"), 1) == expected
    assert cand.benchmark_prompt("countdown", 1, str(tmp_path)) == expected
    with pytest.raises(UserError, match=r"--row 2: benchmark countdown .* has 2 rows"):
        cand.benchmark_prompt(str(tmp_path / "countdown.jsonl"), 2)
    (tmp_path / "notes.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="not a benchmark file name"):
        cand.benchmark_prompt(str(tmp_path / "notes.jsonl"), 0)


def test_bad_input_is_one_clear_user_error(tmp_path):
    with pytest.raises(UserError, match=r"--model .*missing: not an HF model directory"):
        cand.build([MODEL_DIR, str(tmp_path / "missing")], PROMPT)
    with pytest.raises(UserError, match="--prompt: empty"):
        cand.build([MODEL_DIR], "  ")
    other = tmp_path / "other_tok"
    shutil.copytree(MODEL_DIR, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["#"] = vocab.pop("/")  # one token reads differently
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if "/" not in str(m)]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match=r"--model .*other_tok: its tokenizer differs"):
        cand.build([MODEL_DIR, str(other)], PROMPT, response="9+9")
