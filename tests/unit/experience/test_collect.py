"""Experience collection on one process with a scripted engine and verifier: dynamic sampling refills the batch from
the prompt stream (and stops after rollout.refill_max_rounds), the stream stays resumable, the soft overlong penalty
by hand, algo.mask_truncated, the engine's log-probs reaching the batch, and (actor.router_replay=rollout) the
engine's routed experts reaching it at the tokens' positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.config import load_config
from megatron_rlvr.data import PromptItem, PromptLoader
from megatron_rlvr.errors import ConfigError
from megatron_rlvr.experience.collect import RoutingMissingError, collect, overlong_penalty
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rollout import Completion, RolloutConfig
from megatron_rlvr.testing.configs import algo_config
from megatron_rlvr.testing.engines import ScriptedEngineBase

G = 4
SOLVED, FAILED, MIXED = 1, 2, 3  # a prompt's first token says how the scripted engine answers it


class ScriptedEngine(ScriptedEngineBase):
    """Answers "yes" (reward 1) or "no": always for SOLVED / FAILED prompts, on even samples for MIXED ones, so only
    MIXED prompts give informative groups. Sample j of a MIXED prompt has 2 + j tokens (the budget cuts the last)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (prompts, seed) per generate

    def generate(self, prompt_token_ids, n, sampling):
        self.calls.append((len(prompt_token_ids), sampling.seed))
        out = []
        for prompt in prompt_token_ids:
            group = []
            for j in range(n):
                yes = prompt[0] == SOLVED or (prompt[0] == MIXED and j % 2 == 0)
                length = min(2 + j, sampling.max_tokens) if prompt[0] == MIXED else 1
                group.append(
                    Completion(
                        token_ids=[7] * length,
                        logprobs=[-0.5 - 0.1 * t for t in range(length)],
                        text="yes" if yes else "no",
                        finish_reason="length" if length == sampling.max_tokens else "stop",
                    )
                )
            out.append(group)
        return out


class ScriptedPool:
    def score_batch(self, tasks, responses, references):
        return [1.0 if r == "yes" else 0.0 for r in responses], {"items": len(responses)}


def prompt_items(kinds: list[int]) -> list[PromptItem]:
    return [
        PromptItem(id=f"p{i}", prompt="", prompt_ids=(kind, 9), answer="yes", task="scripted")
        for i, kind in enumerate(kinds)
    ]


def _cfg(
    *,
    drop: bool = True,
    rounds: int = 3,
    max_new_tokens: int = 5,
    mask_truncated: bool = False,
    buffer: int = 0,
    penalty: float = 1.0,
    router_replay: str = "none",
):
    return SimpleNamespace(
        actor=ActorConfig(router_replay=router_replay),
        rollout=RolloutConfig(group_size=G, max_new_tokens=max_new_tokens, refill_max_rounds=rounds),
        algo=algo_config({"drop_uniform_groups": drop, "mask_truncated": mask_truncated}),
        reward=RewardConfig(overlong_buffer=buffer, overlong_penalty=penalty),
    )


def _collect(loader, cfg, step=0, engine=None):
    return collect(engine or ScriptedEngine(), ScriptedPool(), loader, cfg, pad_id=0, run_seed=11, step=step)


# one MIXED prompt in five: most groups are uniform
MOSTLY_UNIFORM = [MIXED if i % 5 == 0 else (SOLVED if i % 2 else FAILED) for i in range(60)]


def test_refill_fills_the_batch_where_most_groups_are_uniform():
    loader, engine = PromptLoader(prompt_items(MOSTLY_UNIFORM), 4, seed=3), ScriptedEngine()
    exp = _collect(loader, _cfg(rounds=10), engine=engine)
    kinds = [item.prompt_ids[0] for item in exp.items]
    assert kinds == [MIXED] * 4  # the step trains prompts_per_step informative groups, nothing else
    assert exp.rollouts.tokens.shape[0] == 4 * G and exp.rollouts.response_mask.any(dim=1).all()
    drawn = sum(n for n, _ in engine.calls)
    assert loader.state_dict()["position"] == drawn  # every drawn prompt was consumed from the stream
    assert len({seed for _, seed in engine.calls}) == len(engine.calls) > 1  # each round samples with its own seeds
    m = exp.metrics
    assert m["batch/groups_trained"] == 4 and m["batch/refill_rounds"] == len(engine.calls) - 1
    drawn_kinds = [item.prompt_ids[0] for item in PromptLoader(loader.items, 4, seed=3).draw(drawn)]
    assert m["batch/uniform_groups_dropped"] == sum(kind != MIXED for kind in drawn_kinds)
    # reward/mean is over every response sampled this step: SOLVED 1, FAILED 0, MIXED 1/2
    per_prompt = {SOLVED: 1.0, FAILED: 0.0, MIXED: 0.5}
    assert m["reward/mean"] == pytest.approx(sum(per_prompt[kind] for kind in drawn_kinds) / drawn)


def test_refill_stops_after_refill_max_rounds_and_trains_what_it_has():
    kinds = [MIXED] + [FAILED] * 39  # one informative prompt in forty
    loader, engine = PromptLoader(prompt_items(kinds), 4, seed=0, shuffle=False), ScriptedEngine()
    exp = _collect(loader, _cfg(rounds=2), engine=engine)
    assert [n for n, _ in engine.calls] == [4, 4, 4]  # the first round, then two refills of a full batch each
    m = exp.metrics
    assert m["batch/refill_rounds"] == 2 and m["batch/groups_trained"] == 1
    assert m["batch/uniform_groups_dropped"] == 11
    # the batch keeps its shape: the informative group, then dropped groups whose tokens are masked out
    assert exp.rollouts.tokens.shape[0] == 4 * G
    assert [item.id for item in exp.items] == ["p0", "p1", "p2", "p3"]
    rows_trained = exp.rollouts.response_mask.any(dim=1).view(4, G).all(dim=1)
    assert rows_trained.tolist() == [True, False, False, False]


def test_no_refill_rounds_drops_like_before():
    """refill_max_rounds = 0: the first round's groups in place, the uniform ones masked out (the old behaviour)."""
    loader, engine = (
        PromptLoader(prompt_items([SOLVED, MIXED, FAILED, MIXED]), 4, seed=0, shuffle=False),
        ScriptedEngine(),
    )
    exp = _collect(loader, _cfg(rounds=0), engine=engine)
    assert len(engine.calls) == 1 and [item.id for item in exp.items] == ["p0", "p1", "p2", "p3"]
    assert exp.rollouts.response_mask.any(dim=1).view(4, G).all(dim=1).tolist() == [False, True, False, True]
    assert exp.metrics["batch/groups_trained"] == 2 and exp.metrics["batch/uniform_groups_dropped"] == 2


def test_without_dropping_every_group_trains_and_nothing_refills():
    loader, engine = PromptLoader(prompt_items(MOSTLY_UNIFORM), 4, seed=3), ScriptedEngine()
    exp = _collect(loader, _cfg(drop=False), engine=engine)
    assert len(engine.calls) == 1 and exp.rollouts.response_mask.any(dim=1).all()
    assert exp.metrics["batch/groups_trained"] == 4 and exp.metrics["batch/uniform_groups_dropped"] == 0
    assert exp.metrics["batch/refill_rounds"] == 0
    # a uniform group trains with zero advantages; an informative one with both signs
    adv = exp.targets.advantages.view(4, G)
    kinds = [item.prompt_ids[0] for item in exp.items]
    for kind, row in zip(kinds, adv):
        assert (row == 0).all() == (kind != MIXED)


def test_the_prompt_stream_resumes_exactly_with_refill():
    """Steps 3-4 of an uninterrupted run equal steps 3-4 after resuming from the loader's state at step 2."""
    cfg = _cfg(rounds=3)
    loader = PromptLoader(prompt_items(MOSTLY_UNIFORM), 4, seed=5)
    full, saved = [], None
    for step in range(4):
        full.append(_collect(loader, cfg, step=step))
        if step == 1:
            saved = loader.state_dict()
    assert any(e.metrics["batch/refill_rounds"] > 0 for e in full[2:]), "the compared steps must refill"
    resumed_loader = PromptLoader(prompt_items(MOSTLY_UNIFORM), 4, seed=5)
    resumed_loader.load_state_dict(saved)
    for step in (2, 3):
        got, want = _collect(resumed_loader, cfg, step=step), full[step]
        assert [i.id for i in got.items] == [i.id for i in want.items]
        assert torch.equal(got.rollouts.tokens, want.rollouts.tokens) and got.metrics == want.metrics
    assert resumed_loader.state_dict() == loader.state_dict()


def test_loader_draw_continues_the_same_stream():
    items = prompt_items([FAILED] * 10)
    whole = [i.id for i in PromptLoader(items, 25, seed=2).next_batch()]  # 2.5 epochs in one go
    loader = PromptLoader(items, 4, seed=2)
    pieces = loader.next_batch() + loader.draw(3) + loader.draw(0) + loader.draw(18)
    assert [i.id for i in pieces] == whole
    with pytest.raises(ValueError, match="count >= 0"):
        loader.draw(-1)


def test_overlong_penalty_by_hand():
    """L_max = 10, L_c = 4: no penalty up to 6 tokens, then (6 - L) / 4, -1 at the budget; times the penalty."""
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    got = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, max_new_tokens=10, buffer=0, penalty=0.5).tolist() == [0.0] * 6


def test_overlong_penalty_enters_the_rewards_and_its_knobs_are_checked():
    # MIXED samples have 2, 3, 4, 5 tokens; budget 5, buffer 2: penalties 0, 0, -1/2, -1 (times 1)
    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    exp = _collect(loader, _cfg(drop=False, buffer=2))
    torch.testing.assert_close(exp.rollouts.rewards.view(4, G)[0], torch.tensor([1.0, 0.0, 0.5, -1.0]))
    assert exp.metrics["reward/overlong_penalty"] == pytest.approx(-0.375)
    # the knobs are checked with the rest of the config when it loads, against rollout.max_new_tokens
    for overrides, key in (
        (["reward.overlong_buffer=5"], "reward.overlong_buffer"),
        (["reward.overlong_buffer=-1"], "reward.overlong_buffer"),
        (["reward.overlong_buffer=2", "reward.overlong_penalty=-1.0"], "reward.overlong_penalty"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["rollout.max_new_tokens=5", *overrides]).validate()


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_responses_are_counted_and_masked_when_asked(mask_truncated):
    loader = PromptLoader(prompt_items([MIXED, SOLVED, MIXED, FAILED]), 4, seed=0, shuffle=False)
    exp = _collect(loader, _cfg(drop=False, mask_truncated=mask_truncated))
    # the last sample of each MIXED prompt (5 tokens) reaches the budget: 2 of 16 responses
    assert exp.metrics["response/truncated_frac"] == 2 / 16
    rows = exp.rollouts.response_mask.sum(dim=1).view(4, G)
    assert rows[0].tolist() == ([2, 3, 4, 0] if mask_truncated else [2, 3, 4, 5])
    assert rows[1].tolist() == [1, 1, 1, 1]


def test_engine_log_probs_are_the_rollouts_engine_logp():
    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    exp = _collect(loader, _cfg(drop=False))
    rollouts = exp.rollouts
    assert not hasattr(exp, "engine_logp")  # held once: by the rollouts, which the loss and the mismatch metric read
    # prompt of 2 tokens: response token t (t = 0..) is predicted at position 1 + t
    assert rollouts.engine_logp[1, 1:4].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert (rollouts.engine_logp[~rollouts.response_mask] == 0).all()


def test_prefix_tokens_are_context_not_trained_and_counted():
    """A completion whose first prefix_len tokens came from a weaker model trains only the rest; the share of
    prefixed responses and their mean reward are logged."""

    class PrefixEngine(ScriptedEngine):
        def generate(self, prompt_token_ids, n, sampling):
            out = super().generate(prompt_token_ids, n, sampling)
            for group in out:
                for j, c in enumerate(group):
                    c.prefix_len = 2 if j == 0 else 0  # sample 0 continues a 2-token prefix
            return out

    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    exp = _collect(loader, _cfg(drop=False), engine=PrefixEngine())
    rows = exp.rollouts.response_mask.sum(dim=1).view(4, G)
    assert rows[0].tolist() == [0, 3, 4, 5]  # 2 tokens, both prefix; then 3, 4, 5 trained as before
    # the first trained token of sample 1 (no prefix) is predicted at position 1; of sample 0 none is left
    assert exp.rollouts.response_mask[1, 1] and not exp.rollouts.response_mask[0].any()
    assert exp.metrics["rollout/prefix_frac"] == pytest.approx(1 / G)
    assert exp.metrics["reward/mean_prefixed"] == pytest.approx(1.0)  # sample 0 of a MIXED prompt says "yes"
    plain = _collect(PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False), _cfg(drop=False))
    assert plain.metrics["rollout/prefix_frac"] == 0.0 and "reward/mean_prefixed" not in plain.metrics


def test_an_engine_served_elsewhere_takes_each_ranks_request_whatever_rollout_tp_is():
    from megatron_rlvr.experience.collect import generate

    class Remote(ScriptedEngine):
        ranks_per_engine = 1  # like engine_ranks.RemoteEngine

    items, cfg = prompt_items([SOLVED, MIXED, FAILED]), RolloutConfig(group_size=G, max_new_tokens=5, tp=2)
    engine = Remote()
    out = generate(engine, items, cfg, run_seed=11, step=0)  # one rank, rollout.tp=2: no colocated TP group
    assert [len(group) for group in out] == [G] * 3 and engine.calls[0][0] == 3


class RoutingEngine(ScriptedEngine):
    """Routes token j of a sequence at MoE layer l (of 3) to experts ((j + l) % 8, (j + l + 1) % 8), a pattern the
    test reads back. ``flaw``: "missing" returns no routing, "short" leaves out the last token (as an engine that
    never feeds it back does), "wrong" returns 2 MoE layers instead of 3."""

    def __init__(self, flaw: str = "") -> None:
        super().__init__()
        self.flaw = flaw

    def generate(self, prompt_token_ids, n, sampling):
        out = super().generate(prompt_token_ids, n, sampling)
        for prompt, group in zip(prompt_token_ids, out):
            for c in group:
                tokens = len(prompt) + len(c.token_ids) - (self.flaw == "short")
                j = torch.arange(tokens)[:, None, None]
                layer = torch.arange(3)[None, :, None]
                slot = torch.arange(2)[None, None, :]
                c.routed_experts = None if self.flaw == "missing" else (j + layer + slot) % 8
                if self.flaw == "wrong":
                    c.routed_experts = c.routed_experts[:, :2]
        return out


@pytest.mark.parametrize("short", [False, True])
def test_rollout_replay_carries_the_engines_routed_experts_like_the_tokens(short):
    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    exp = _collect(loader, _cfg(drop=False, router_replay="rollout"), engine=RoutingEngine("short" if short else ""))
    routed = exp.rollouts.routed_experts
    assert routed.shape == (*exp.rollouts.tokens.shape, 3, 2) and routed.dtype == torch.int16
    lengths = [2 + len(c.token_ids) for group in exp.completions for c in group]
    for i, n in enumerate(lengths):
        kept = n - short
        j = torch.arange(kept)[:, None, None]
        assert torch.equal(routed[i, :kept].long(), ((j + torch.arange(3)[:, None] + torch.arange(2)) % 8))
        assert bool((routed[i, kept:] == -1).all())  # padding (and a token the engine left out): not routed
    assert all(c.routed_experts is None for group in exp.completions for c in group)  # moved into the batch
    # micro-batches select rows: the routing travels with them
    assert torch.equal(exp.rollouts.select(torch.tensor([2, 0])).routed_experts, routed[[2, 0]])


def test_without_rollout_replay_the_batch_carries_no_routing():
    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    assert (
        _collect(loader, _cfg(drop=False, router_replay="train"), engine=RoutingEngine()).rollouts.routed_experts
        is None
    )


@pytest.mark.parametrize(
    "flaw, message",
    [
        ("missing", "actor.router_replay=rollout: the rollout engine returned no routed_experts for completion 0"),
        (
            "wrong",
            "Completion.routed_experts of completion 1: expected [5, 3, 2] (prompt + response tokens), got [5, 2, 2]",
        ),
    ],
)
def test_rollout_replay_without_good_routing_is_one_line_naming_it(flaw, message):
    class FirstGood(RoutingEngine):
        def generate(self, prompt_token_ids, n, sampling):
            out = super().generate(prompt_token_ids, n, sampling)
            if self.flaw == "wrong":  # the first completion is fine: the second's shape is checked against it
                out[0][0].routed_experts = (
                    RoutingEngine().generate(prompt_token_ids[:1], 1, sampling)[0][0].routed_experts
                )
            return out

    loader = PromptLoader(prompt_items([MIXED] * 4), 4, seed=0, shuffle=False)
    with pytest.raises(RoutingMissingError) as info:
        _collect(loader, _cfg(drop=False, router_replay="rollout"), engine=FirstGood(flaw))
    assert message in str(info.value) and "\n" not in str(info.value)
