"""Token in, token out on the real engine: a three-turn trajectory of the CPU vLLM engine against a user's
environment, the batch collection builds from it, and an fp32 HF model reading that batch as the actor does."""

import pytest
import torch

from megatron_rlvr.data import PromptItem
from megatron_rlvr.environments import EnvironmentConfig, Problem
from megatron_rlvr.environments.episodes import EpisodeRunner
from megatron_rlvr.environments.glue import TurnGlue
from megatron_rlvr.experience.collect import to_rollouts
from megatron_rlvr.rollout import RolloutConfig, Sampling
from megatron_rlvr.rollout.vllm_engine import VLLMEngine
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
from tests.support.environments.env_helpers import chat_tokenizer, write_user_environment
from tests.support.rollout.hf_reference import hf_token_logprobs, load_hf

pytestmark = pytest.mark.engine

TOL = 1e-4  # the engine tests' fp32 tolerance (tests/integration/rollout/test_vllm_engine.py)


class Recording:
    """The engine, with every request it was given and what it sampled."""

    def __init__(self, engine):
        self.engine, self.ranks_per_engine, self.calls = engine, None, []

    def generate(self, prompt_token_ids, n, sampling):
        out = self.engine.generate(prompt_token_ids, n, sampling)
        self.calls += [(list(p), group[0]) for p, group in zip(prompt_token_ids, out)]
        return out

    def close(self):
        self.engine.close()


def test_three_turns_train_exactly_the_engines_ids_with_the_engines_logprobs(tmp_path):
    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2")
    tok = chat_tokenizer()
    cfg = EnvironmentConfig(name=f"{write_user_environment(tmp_path)}:ThreeTurns", workers=1, turn_max_tokens=6)
    engine = Recording(VLLMEngine(model_dir, RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20), seed=0))
    runner = EpisodeRunner(engine, cfg, TurnGlue(tok, "tool", 16, (tok.eos_token_id,)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    item = PromptItem("p", "hi", tuple(prompt), answer=None, task="echo")
    try:
        (group,) = runner.play([Problem("p", "hi", tuple(prompt), "echo", None)], 1, Sampling(max_tokens=150, seed=3))
        # the first turn is what single-turn generation draws: no tool call, the same response
        (single,) = engine.engine.generate([list(prompt)], 1, Sampling(max_tokens=6, seed=3))
    finally:
        runner.close()
    assert single[0].token_ids == engine.calls[0][1].token_ids
    (c,) = group
    assert c.episode.turns == 3 and c.episode.env_return == 1.5 and len(engine.calls) == 3

    # the ids: the prompt, then each turn's sampled ids and the template's glue, as the engine saw them
    expected, mask = list(prompt), []
    for k, (request, sampled) in enumerate(engine.calls):
        assert request == expected  # each turn continued the running ids exactly
        expected += sampled.token_ids
        mask += [1] * len(sampled.token_ids)
        if k < 2:
            end = "" if sampled.token_ids[-1] == tok.eos_token_id else tok.eos_token
            glue = tok(f"{end}\n<|im_start|>tool\nobs{k + 1}{tok.eos_token}\n<|im_start|>assistant\n")["input_ids"]
            expected += glue
            mask += [0] * len(glue)
    assert list(prompt) + c.token_ids == expected and c.episode.loss_mask == mask

    batch = to_rollouts([item], [group], torch.zeros(1), pad_id=tok.eos_token_id)
    engine_logp = batch.engine_logp
    seq = batch.tokens[0].tolist()
    assert seq == expected  # what the actor trains on
    p = len(prompt)
    trained = batch.response_mask[0]
    assert trained[p - 1 :].tolist() == [bool(m) for m in mask] and not trained[: p - 1].any()
    # the engine's log-probs of the sampled tokens are the model's own on the batch's ids
    actor = hf_token_logprobs(load_hf(model_dir), seq, start=1)
    assert (engine_logp[0][trained] - actor[trained]).abs().max().item() <= TOL
