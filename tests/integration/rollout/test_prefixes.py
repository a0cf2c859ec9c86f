"""PrefixedEngine: outer prefixes from a weak engine, continued by the target (rollout/prefixes.py).

Fake engine pairs check the Completion fields, determinism, the share and the cut; one test with the CPU vLLM engines
on the demo and weak models checks the log-probs against plain transformers forwards.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rlvr.rollout import RolloutConfig, RolloutEngine, Sampling
from megatron_rlvr.rollout.base import Completion
from megatron_rlvr.rollout.prefixes import PrefixedEngine, check_prefix_model, prefixed_count
from megatron_rlvr.testing.engines import ScriptedEngineBase

EOS = 0
CHARS = "\x00abcdefgh;"  # id -> character; id 0 is EOS (decodes to nothing), ";" (id 9) the stop string's


def decode(ids: list[int]) -> str:
    return "".join(CHARS[t] for t in ids if t != EOS)


class Fake(ScriptedEngineBase):
    """Deterministic engine: answers depend on (name, seed, position, prompt, sample). Log-probs mark the engine."""

    def __init__(self, name: str, mark: float):
        self.name, self.mark = name, mark
        self.calls: list[tuple[list[list[int]], int, Sampling]] = []
        self.events: list[str] = []

    def generate(self, prompt_token_ids, n, sampling):
        self.calls.append(([list(p) for p in prompt_token_ids], n, sampling))
        out = []
        for pos, prompt in enumerate(prompt_token_ids):
            group = []
            for j in range(n):
                rng = random.Random(f"{self.name}/{sampling.seed}/{pos}/{prompt}/{j}")
                ids = [rng.randint(1, 8) for _ in range(rng.randint(1, sampling.max_tokens))]
                finish = "length"
                if len(ids) < sampling.max_tokens:
                    ids.append(EOS if rng.random() < 0.5 else 9)  # an EOS or a stop string (";") ends it
                    finish = "stop"
                text = decode(ids[:-1] if finish == "stop" else ids)  # like vLLM: the stop string is not in text
                lp = [self.mark] * len(ids) if sampling.logprobs else []
                group.append(Completion(token_ids=ids, logprobs=lp, text=text, finish_reason=finish))
            out.append(group)
        return out

    def update_weights(self, weights, lent=False):
        self.events.append("update_weights")
        list(weights)

    def sleep(self):
        self.events.append("sleep")

    def wake(self):
        self.events.append("wake")


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 1]]


def _engine(fraction=0.5, cut=(0.2, 0.8)):
    target, weak = Fake("target", -2.0), Fake("weak", -1.0)
    return PrefixedEngine(target, weak, fraction, cut, decode=decode), target, weak


def _sampling(seed=7, max_tokens=12, logprobs=True, min_tokens=0):
    return Sampling(max_tokens=max_tokens, min_tokens=min_tokens, seed=seed, stop=[";"], logprobs=logprobs)


def test_prefixed_samples_carry_the_weak_prefix_and_the_targets_continuation():
    engine, target, weak = _engine(fraction=0.5)
    assert isinstance(engine, RolloutEngine)
    sampling = _sampling(min_tokens=6)
    out = engine.generate(PROMPTS, 4, sampling)
    plain_call, weak_call = target.calls[0], weak.calls[0]
    assert plain_call[1] == 2 and plain_call[2] == sampling  # the plain half: the same call as without prefixes
    assert weak_call[1] == 2 and weak_call[2].seed != sampling.seed  # weak answers: 2 per prompt, own seed
    answers = weak.generate(PROMPTS, 2, weak_call[2])
    plain = target.generate(PROMPTS, 2, sampling)
    continuation_calls = target.calls[1:-1]  # between the plain call and the two replays above
    assert sum(len(c[0]) for c in continuation_calls) == len(PROMPTS) * 2
    prefixed = 0
    for i, group in enumerate(out):
        assert len(group) == 4 and group[:2] == plain[i]
        assert all(c.prefix_len == 0 for c in group[:2])
        for j, c in enumerate(group[2:]):
            p, answer = c.prefix_len, answers[i][j]
            assert c.token_ids[:p] == answer.token_ids[:p] and EOS not in c.token_ids[:p]
            assert len(c.logprobs) == len(c.token_ids)
            assert c.logprobs[:p] == [-1.0] * p and c.logprobs[p:] == [-2.0] * (len(c.token_ids) - p)
            # the continuation came from one call on prompt + prefix, with the budget left
            (call,) = [call for call in continuation_calls if PROMPTS[i] + c.token_ids[:p] in call[0]]
            assert call[1] == 1 and call[2].max_tokens == sampling.max_tokens - p
            assert call[2].min_tokens == max(0, 6 - p)  # prefix + continuation: at least min_tokens in all
            assert len(c.token_ids) <= sampling.max_tokens
            k = call[0].index(PROMPTS[i] + c.token_ids[:p])
            cont = target.generate(call[0], 1, call[2])[k][0]
            assert c.token_ids[p:] == cont.token_ids and c.finish_reason == cont.finish_reason
            assert c.text == decode(c.token_ids[:p]) + cont.text
            prefixed += p > 0
    assert prefixed >= 3  # the check above saw real prefixes


def test_prefix_tokens_are_masked_out_of_the_loss():
    from megatron_rlvr.data import PromptItem
    from megatron_rlvr.experience.collect import to_rollouts

    out = _engine(fraction=0.5)[0].generate(PROMPTS, 4, _sampling())
    items = [
        PromptItem(id=str(i), prompt="", prompt_ids=tuple(p), answer="", task="math") for i, p in enumerate(PROMPTS)
    ]
    batch = to_rollouts(items, out, torch.zeros(12), pad_id=0)
    row = 0
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            trained = batch.response_mask[row].nonzero()[:, 0].tolist()
            start = len(prompt) - 1 + c.prefix_len  # position t predicts token t + 1
            assert trained == list(range(start, len(prompt) - 1 + len(c.token_ids)))
            row += 1
    assert any(c.prefix_len for g in out for c in g)


def test_same_seed_same_samples_other_seed_other_prefixes():
    a = _engine()[0].generate(PROMPTS, 4, _sampling(seed=3))
    assert a == _engine()[0].generate(PROMPTS, 4, _sampling(seed=3))
    b = _engine()[0].generate(PROMPTS, 4, _sampling(seed=4))
    assert [c.token_ids for g in a for c in g[2:]] != [c.token_ids for g in b for c in g[2:]]


@pytest.mark.parametrize(
    "fraction, n, k", [(0.0, 4, 0), (0.25, 2, 1), (0.25, 8, 2), (0.5, 3, 2), (1.0, 4, 4), (0.3, 10, 3)]
)
def test_share_of_prefixed_samples(fraction, n, k):
    assert prefixed_count(fraction, n) == k
    engine, target, weak = _engine(fraction=fraction)
    out = engine.generate(PROMPTS, n, _sampling())
    assert all(len(g) == n for g in out)
    assert len(weak.calls) == (k > 0) and (k == 0 or weak.calls[0][1] == k)
    assert (target.calls[0][1] == n - k) if k < n else all(call[1] == 1 for call in target.calls)


def test_cut_falls_in_the_range_of_the_answer_without_its_final_token():
    lo, hi = 0.3, 0.6
    engine, _, weak = _engine(fraction=1.0, cut=(lo, hi))
    fractions = []
    for seed in range(40):
        out = engine.generate(PROMPTS, 2, _sampling(seed=seed, max_tokens=30))
        answers = weak.generate(PROMPTS, 2, weak.calls[-1][2])  # the weak call just made, replayed
        for group, ans in zip(out, answers):
            for c, a in zip(group, ans):
                length = len(a.token_ids) - (a.finish_reason == "stop")  # the EOS or stop token never in a prefix
                assert math.floor(lo * length) <= c.prefix_len <= math.floor(hi * length)
                if length >= 10:
                    fractions.append(c.prefix_len / length)
    assert min(fractions) < lo + 0.1 and max(fractions) > hi - 0.1  # uniform over the range, not one point


def test_exact_cut_and_budget_floor():
    engine, _, weak = _engine(fraction=1.0, cut=(1.0, 1.0))
    sampling = _sampling(max_tokens=5)
    out = engine.generate(PROMPTS, 3, sampling)
    answers = weak.generate(PROMPTS, 3, weak.calls[0][2])
    for group, ans in zip(out, answers):
        for c, a in zip(group, ans):
            whole = len(a.token_ids) - (a.finish_reason == "stop")
            assert c.prefix_len == min(whole, sampling.max_tokens - 1)  # the target writes at least one token


def test_a_cut_never_ends_inside_a_stop_string():
    class Weak(Fake):
        def generate(self, prompt_token_ids, n, sampling):
            self.calls.append((prompt_token_ids, n, sampling))
            ids = [1, 2, 8, 3, 4, 5, 0]  # "abhcde" then EOS
            return [[Completion(ids, [-1.0] * 7, "abhcde", "stop")] * n for _ in prompt_token_ids]

    target = Fake("target", -2.0)
    engine = PrefixedEngine(target, Weak("weak", -1.0), 1.0, (0.5, 0.5), decode=decode)
    # cut at 3 tokens: "abh"; with stop string "hc" the prefix would end in its first character: moved to "ab"
    out = engine.generate([[1]], 1, Sampling(max_tokens=10, seed=0, stop=["hc"]))
    assert out[0][0].prefix_len == 2
    out = engine.generate([[1]], 1, Sampling(max_tokens=10, seed=0, stop=["xy"]))
    assert out[0][0].prefix_len == 3


def test_without_logprobs_none_are_returned():
    out = _engine()[0].generate(PROMPTS, 4, _sampling(logprobs=False))
    assert all(c.logprobs == [] for g in out for c in g)


def test_weights_and_sleep_go_to_the_target_only():
    engine, target, weak = _engine()
    engine.update_weights(iter([("w", None)]))
    engine.sleep()
    engine.wake()
    assert target.events == ["update_weights", "sleep", "wake"] and weak.events == []
    assert engine.alive


def test_engine_ranks_answer_the_actors_requests_with_the_target_alone():
    from megatron_rlvr.experience.engine_server import answer

    engine, target, weak = _engine(fraction=1.0)
    requests = [(PROMPTS[:2], 3, _sampling(seed=1)), ([], 2, _sampling(seed=2)), (PROMPTS[2:], 1, _sampling(seed=3))]
    answers = answer(engine, requests, tp=1)  # validation, PBA's base evidence: the model itself, no prefixes
    assert weak.calls == [] and all(c.prefix_len == 0 for a in answers for group in a for c in group)
    assert answers == [target.generate(p, n, s) if p else [] for p, n, s in requests]


DEMO = Path(__file__).resolve().parents[3] / "megatron_rlvr" / "demo"


def test_tokenizer_mismatch_is_a_clear_error(tmp_path):
    from megatron_rlvr.errors import ConfigError

    check_prefix_model(DEMO / "model", DEMO / "weak_model")
    other = tmp_path / "other"
    shutil.copytree(DEMO / "weak_model", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same strings, other meaning of the ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="rollout.prefix_model.*vocabularies differ"):
        check_prefix_model(DEMO / "model", other)
    shutil.copy(DEMO / "weak_model" / "tokenizer.json", other / "tokenizer.json")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 8}))
    with pytest.raises(ConfigError, match="config vocab_size"):
        check_prefix_model(DEMO / "model", other)
    with pytest.raises(ConfigError, match="not an HF model directory"):
        check_prefix_model(DEMO / "model", tmp_path / "missing")


@pytest.mark.engine
def test_vllm_continuations_have_the_targets_logprobs_and_prefixes_the_weak_ones():
    """The demo model continues the weak model's prefixes on CPU vLLM; a plain transformers forward of each model on
    prompt + response gives the engine's log-probs: the weak's on the prefix, the target's on the continuation."""
    from transformers import AutoTokenizer

    from megatron_rlvr.rollout import make_engine
    from megatron_rlvr.tasks import countdown as task
    from tests.support.rollout.hf_reference import hf_logprob_bound, hf_token_logprobs, load_hf

    cfg = RolloutConfig(
        max_model_len=128,
        kv_cache_memory_bytes=32 * 1024**2,
        prefix_model=str(DEMO / "weak_model"),
        prefix_fraction=0.5,
        prefix_cut=[0.3, 0.9],
    )
    engine = make_engine(DEMO / "model", cfg, seed=0)
    try:
        assert isinstance(engine, PrefixedEngine)
        tok = AutoTokenizer.from_pretrained(DEMO / "model")
        prompts = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in task.generate(0, 6, "eval")]
        sampling = Sampling(temperature=1.0, max_tokens=24, stop=["\n"], seed=11)
        out = engine.generate(prompts, 4, sampling)
        again = engine.generate(prompts, 4, sampling)
    finally:
        engine.close()
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in again]
    target, weak = load_hf(DEMO / "model"), load_hf(DEMO / "weak_model")
    worst_target = worst_weak = 0.0
    seen, target_seqs, weak_seqs = 0, [], []
    for prompt, group in zip(prompts, out):
        assert [c.prefix_len > 0 for c in group][:2] == [False, False]
        for c in group[2:]:
            p, seq = c.prefix_len, prompt + c.token_ids
            assert len(c.logprobs) == len(c.token_ids) <= sampling.max_tokens
            assert tok.decode(c.token_ids, skip_special_tokens=True).startswith(c.text)
            assert "\n" not in tok.decode(c.token_ids[:p])  # the weak answer's stop token is never in a prefix
            got = hf_token_logprobs(target, seq, start=len(prompt) + p)
            target_seqs.append(seq)
            worst_target = max(worst_target, (got - torch.tensor(c.logprobs[p:])).abs().max().item())
            if p:
                lp_weak = hf_token_logprobs(weak, prompt + c.token_ids[:p], start=len(prompt))
                weak_seqs.append(prompt + c.token_ids[:p])
                worst_weak = max(worst_weak, (lp_weak - torch.tensor(c.logprobs[:p])).abs().max().item())
                seen += 1
    assert seen >= 3
    # each within fp32 rounding of transformers' (megatron_rlvr/testing/rounding.py)
    assert worst_target <= hf_logprob_bound(target, target_seqs) and worst_weak <= hf_logprob_bound(weak, weak_seqs)
