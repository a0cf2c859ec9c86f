"""Chat prompts on the real SmolLM2-135M-Instruct (ChatML, `<|im_end|>` ends a turn and is the EOS): the engine a
run builds stops at the end of turn, and the responses the actor trains on end with that token, inside the
response mask (so the update learns to end the turn); the text the verifier reads holds no marker."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_the_run_engine_stops_at_the_end_of_turn_and_the_batch_trains_on_it(smollm2_hf_dir):
    from transformers import AutoTokenizer

    from megatron_rlvr.config import load_config
    from megatron_rlvr.data import DataConfig, items_from_rows
    from megatron_rlvr.data.sources import Row
    from megatron_rlvr.experience.collect import generate, to_rollouts
    from megatron_rlvr.experience.construction import chat_stop_ids, make_rollout_engine
    from megatron_rlvr.problems.prompt_encoding import end_of_turn_id

    overrides = [
        f"model.hf_dir={smollm2_hf_dir}",
        "data.chat_template=true",
        "rollout.group_size=8",
        "rollout.max_new_tokens=48",
        "rollout.max_model_len=256",
        "rollout.kv_cache_memory_bytes=67108864",
    ]
    cfg = load_config(None, overrides)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    im_end = end_of_turn_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(im_end) == "<|im_end|>" and chat_stop_ids(cfg) == (im_end,)
    assert chat_stop_ids(load_config(None, overrides[:1])) == ()  # raw prompts: the model's EOS alone
    rows = [Row(f"q:{i}", "q", i, {"problem": q, "answer": "x"}) for i, q in enumerate(["Calculate 5 - 3.", "Hi!"])]
    items, _ = items_from_rows(rows, DataConfig(chat_template=True, system_prompt="Be brief."), tokenizer)
    engine = make_rollout_engine(cfg, rank=0)
    try:
        completions = generate(engine, items, cfg.rollout, run_seed=1, step=0)
    finally:
        engine.close()
    flat = [c for group in completions for c in group]
    ended = [c for c in flat if c.finish_reason == "stop"]
    assert ended, "no response ended its turn within 48 tokens"
    for c in flat:
        assert im_end not in c.token_ids[:-1] and "<|im_end|>" not in c.text
        assert (c.token_ids[-1] == im_end) == (c.finish_reason == "stop")
    batch = to_rollouts(items, completions, torch.zeros(len(flat)), pad_id=tokenizer.pad_token_id)
    for row, c in enumerate(flat):
        last = len(items[row // 8].prompt_ids) + len(c.token_ids) - 1  # the response's last token
        assert batch.tokens[row, last] == c.token_ids[-1]
        assert batch.response_mask[row, last - 1]  # position last - 1 predicts it: trained
        assert not batch.response_mask[row, last:].any()
