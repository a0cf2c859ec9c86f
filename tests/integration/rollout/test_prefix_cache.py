"""KV that matches its version tag (rollout/prefix_cache.py): on the vLLM-CPU engine a prompt longer than two KV
blocks is in flight in the stream when the weights change, and a second prompt with the same 290-token head is
admitted after the update. Its blocks in the prefix cache were computed by the old weights and are still in use, so
vLLM cannot forget them; the new prompt must not read them. Its engine log-probs equal those of an engine freshly
loaded with the new weights, within fp32 rounding (megatron_rlvr/testing/rounding.py), its tokens carry the new
version, and the new weights move those log-probs by far more than that bound (the comparison can fail: before
the prefix cache was salted by weights it did, by 0.1-2 nats). At vLLM-CPU's own block size (128) and at 32."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rlvr.config import load_config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.experience.stream import StreamCore
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.hf_config import read_hf_config
from megatron_rlvr.rollout.vllm_engine import make_engine
from megatron_rlvr.testing.rounding import fp32_logprob_bound
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
from tests.support.rollout.hf_reference import hf_state_dict, hf_token_logprobs, load_hf, load_into_hf, perturbed

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HEAD, TAIL, ANSWER = 290, 10, 16  # the shared head covers two 128-token blocks; answers of up to 16 tokens
# (no min_new_tokens: it masks EOS, and the engine's log-probs would be of that masked distribution)
BEFORE = 3  # engine steps of the first prompt before the update


class Pool:
    def score_batch(self, tasks, responses, references):
        return [float(i % 2) for i in range(len(responses))], {"items": len(responses)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("prefix") / "qwen2", seed=11)
    hf = load_hf(model_dir)
    new = perturbed(hf_state_dict(hf), seed=3)
    rng = random.Random(0)
    head = [rng.randrange(1000) for _ in range(HEAD)]
    prompts = [head + [rng.randrange(1000) for _ in range(TAIL)] for _ in range(2)]
    return model_dir, hf, new, prompts


def _cfg(block_size: int):
    return load_config(
        None,
        [
            "rollout.max_staleness=0",  # one group in flight per version: the second is admitted after the update
            "trainer.prompts_per_step=1",
            "rollout.group_size=2",
            f"rollout.max_new_tokens={ANSWER}",
            "rollout.max_model_len=512",
            f"rollout.kv_cache_memory_bytes={32 << 20}",
            f"rollout.kv_block_size={block_size}",
        ],
    )


def _stream_across_an_update(model_dir, new, prompts, block_size: int):
    """The stream's own steps (stream_server.py's "weights" command: load, then the new version): the first prompt
    admitted at version 0, the update after BEFORE engine steps, the second admitted at version 1. Returns the
    second prompt's group."""
    cfg = _cfg(block_size)
    engine = make_engine(model_dir, cfg.rollout)
    try:
        items = [PromptItem(f"p{i}", "", tuple(p), "", "scripted") for i, p in enumerate(prompts)]
        core = StreamCore(
            engine.stream(),
            Pool(),
            PromptLoader(items, 1, seed=0, shuffle=False),
            cfg,
            pad_id=0,
            replica=0,
            replicas=1,
            shipper=True,
            start_step=0,
            version=0,
        )
        assert core.admit() == 1
        for _ in range(BEFORE):
            assert core.advance()
        engine.update_weights(iter(new.items()))  # the first prompt's blocks are in use: vLLM cannot reset
        core.version = 1
        assert core.admit() == 1 and engine.stream().in_flight() == 2
        groups = {}
        while len(groups) < 2:
            assert core.advance()
            groups |= {done.index: done.group for done in core.events().done}
        return groups[1]
    finally:
        engine.close()


def _bound_and_moved(model_dir, hf, new, prompt_len: int, sequences) -> tuple[float, float]:
    """The fp32 bound for these sequences under the new weights (their logits' size from transformers), and how far
    the update moved their answers' log-probs (transformers, old weights vs new)."""
    old = [hf_token_logprobs(hf, s, start=prompt_len) for s in sequences]
    load_into_hf(hf, new)
    try:
        with torch.no_grad():
            max_logit = max(hf(torch.tensor([s])).logits.abs().max().item() for s in sequences)
        moved = max((hf_token_logprobs(hf, s, start=prompt_len) - o).abs().max().item() for s, o in zip(sequences, old))
    finally:
        load_into_hf(hf, hf_state_dict(load_hf(model_dir)))
    dims = ModelDims.from_hf(read_hf_config(model_dir))
    return fp32_logprob_bound(dims, max(map(len, sequences)), max_logit), moved


@pytest.fixture(scope="module")
def fresh(setup):
    model_dir, _, new, _ = setup
    engine = make_engine(model_dir, _cfg(0).rollout)
    engine.update_weights(iter(new.items()))
    yield engine
    engine.close()


@pytest.mark.parametrize("block_size", [0, 32])  # 0: vLLM-CPU's default, 128 tokens
def test_a_prompt_admitted_after_an_update_reads_no_block_of_the_old_weights(setup, fresh, block_size):
    model_dir, hf, new, prompts = setup
    group = _stream_across_an_update(model_dir, new, prompts, block_size)
    prompt = prompts[1]
    sequences = [prompt + c.token_ids for c in group.completions]
    reference = [torch.tensor(lp[len(prompt) - 1 :]) for lp in fresh.prompt_logprobs(sequences)]
    gaps = [(torch.tensor(c.logprobs) - ref).abs().max().item() for c, ref in zip(group.completions, reference)]

    bound, moved = _bound_and_moved(model_dir, hf, new, len(prompt), sequences)
    print(
        f"block {block_size or 128}: |engine - fresh engine| per response {gaps}; bound {bound:.3g}; moved {moved:.3g}"
    )
    assert all(c.versions == [1] * len(c.token_ids) and c.token_ids for c in group.completions)
    assert moved > 100 * bound  # the new weights are visible: reading the old blocks would fail the next line
    assert all(g <= bound for g in gaps), gaps


def test_a_prompt_added_before_an_update_that_has_not_started_starts_under_the_new_weights(setup, fresh):
    """A request waiting in vLLM's queue at an update (here: added, no step yet) would look its prefix up under the
    old weights' salt: the stream restarts it under the new one, with the same seed."""
    from megatron_rlvr.rollout import Sampling

    model_dir, hf, new, prompts = setup
    engine = make_engine(model_dir, _cfg(0).rollout)
    try:
        stream = engine.stream()
        sampling = Sampling(temperature=1.0, max_tokens=ANSWER, seed=5)
        stream.submit("a", prompts[0], 2, sampling)
        for _ in range(BEFORE):
            stream.step()
        stream.submit("b", prompts[1], 2, sampling)  # not started when the weights change
        engine.update_weights(iter(new.items()))
        answers = [[], []]
        while stream.in_flight():
            for news in stream.step():
                if news.key == "b":
                    answers[news.index].extend(zip(news.token_ids, news.logprobs))
    finally:
        engine.close()
    sequences = [prompts[1] + [t for t, _ in a] for a in answers]
    reference = fresh.prompt_logprobs(sequences)
    gaps = [
        (torch.tensor([lp for _, lp in a]) - torch.tensor(ref[len(prompts[1]) - 1 :])).abs().max().item()
        for a, ref in zip(answers, reference)
    ]
    bound, moved = _bound_and_moved(model_dir, hf, new, len(prompts[1]), sequences)
    print(f"waiting at the update: |engine - fresh engine| per response {gaps}; bound {bound:.3g}; moved {moved:.3g}")
    assert moved > 100 * bound
    assert all(g <= bound for g in gaps), gaps
