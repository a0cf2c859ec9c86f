"""Stand-ins for the methods that turn a prompt's reference solution into a response (demonstrations, ground-truth
injection): a tokenizer of one id per character, and a reward pool that scores countdown in this process."""

from __future__ import annotations

from megatron_rlvr.rewards.countdown import score_countdown


class CharTokenizer:
    eos_token_id = 99

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class CountdownPool:
    def score_batch(self, tasks, responses, references):
        return [score_countdown(r, ref) for r, ref in zip(responses, references)], {}
