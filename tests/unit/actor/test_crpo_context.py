"""CRPO's privileged context (actor/teacher.py, CorrectResponseContext): each row reads the next correct response of
its own group other than itself (itself when it is the only one), token for token inside the template; a group
without a correct response has no context; rewards of the wrong shape are a one-line error."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.actor.teacher import CorrectResponseContext, privileged_batch, realign
from megatron_rlvr.protocols import Rollouts
from megatron_rlvr.testing.handoffs import rollouts


class CharTokenizer:
    """ids = code points (a stand-in: the context only tokenizes the template's text around {answer})."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def _batch(rewards: list[float]) -> Rollouts:
    """Rows of prompt [1, 2] + a response [10 + i, 20 + i] (row i), right-padded to 5 tokens."""
    b = len(rewards)
    tokens = torch.zeros(b, 5, dtype=torch.long)
    mask = torch.zeros(b, 4, dtype=torch.bool)
    for i in range(b):
        tokens[i, :4] = torch.tensor([1, 2, 10 + i, 20 + i])
        mask[i, 1:3] = True
    return rollouts(tokens, mask, rewards=torch.tensor(rewards))


def test_each_row_reads_another_correct_response_of_its_group():
    context = CorrectResponseContext(CharTokenizer(), "<{answer}>", correct_reward=1.0)
    batch = _batch([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0])  # groups of 4: rows 0, 2 correct; row 7 alone
    prefixes, groups = context.prefixes(batch, 4)
    group, has = groups.group, groups.has_context
    lt, gt = ord("<"), ord(">")
    assert prefixes[0] == [lt, 12, 22, gt]  # row 0: the next correct one after it, row 2
    assert prefixes[1] == [lt, 12, 22, gt]  # row 1 (wrong): the next correct one after it
    assert prefixes[2] == [lt, 10, 20, gt]  # row 2: cyclically, row 0
    assert prefixes[3] == [lt, 10, 20, gt]
    assert all(p == [lt, 17, 27, gt] for p in prefixes[4:])  # row 7 is its group's only correct one: itself too
    assert group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and has.all()


def test_a_group_without_a_correct_response_has_no_context_and_is_aligned_back():
    context = CorrectResponseContext(CharTokenizer(), "{answer}|", correct_reward=1.0)
    batch = _batch([0.0, 0.0, 1.0, 0.0])
    prefixes, groups = context.prefixes(batch, 2)
    has = groups.has_context
    assert prefixes[:2] == [[], []] and has.tolist() == [False, False, True, True]
    scored, shifts = privileged_batch(batch, prefixes)
    assert shifts.tolist() == [0, 0, 3, 3]
    back = realign(scored.tokens[:, 1:].float(), shifts, batch.response_mask.shape[1])
    torch.testing.assert_close(back, batch.tokens[:, 1:].float())  # every row's own tokens at its own positions


def test_rewards_of_another_shape_are_one_line():
    import dataclasses

    batch = dataclasses.replace(_batch([1.0, 0.0]), rewards=torch.zeros(3))
    with pytest.raises(ValueError, match=r"^rollouts.rewards: algo.distill.kind=crpo needs the rewards \[B\] = \[2\]"):
        CorrectResponseContext(CharTokenizer(), "{answer}", 1.0).prefixes(batch, 2)
