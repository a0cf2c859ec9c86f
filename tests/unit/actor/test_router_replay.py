"""actor/router_replay.py on one process: the router hook's replay math, routing ids following tokens into the packed
stream (or the padded block's order) and back, and the one-line errors (a dense model, ids of the wrong shape or
range, rollout replay without the engine's ids). The actor passes are in test_router_replay_actor.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.actor.packing import pack
from megatron_rlvr.actor.router_replay import RouterReplayer, RouterReplayError, _LayerReplay, moe_layer_indices
from megatron_rlvr.protocols import Sequences


def _tcfg(arch: str = "qwen3_moe", **overrides):
    from megatron_rlvr.models import load_hf_config, transformer_config_from_hf
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_config

    cfg = make_tiny_hf_config(arch)
    hf = cfg.to_dict()
    hf["architectures"] = list(cfg.architectures)
    return transformer_config_from_hf(load_hf_config(hf), **overrides)


def _batch(routed: torch.Tensor | None = None) -> Sequences:
    lengths = [5, 3, 4]
    tokens = torch.arange(15).reshape(3, 5) + 1
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 1 : n - 1] = True
    return Sequences(tokens=tokens, response_mask=mask, routed_experts=routed)


def _run_pass(replayer: RouterReplayer, batch: Sequences, kind: str) -> None:
    with replayer.pass_over(batch, [[[0, 1, 2]]], kind):
        pass


def test_moe_layers_follow_megatrons_pattern():
    tcfg = _tcfg()
    assert moe_layer_indices(tcfg) == [0, 2, 3]  # the tiny model's layer 1 is dense (mlp_only_layers)
    assert moe_layer_indices(SimpleNamespace(moe_layer_freq=2, num_layers=5)) == [0, 2, 4]


def _default_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_routes_onto_the_given_experts_with_the_routers_own_scores_and_own_choice_where_unknown():
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.9], [0.3, 0.2, 0.8, 0.1], [0.4, 0.6, 0.0, 0.2]])
    hook = _LayerReplay(0)
    hook.action, hook.target = "replay", torch.tensor([[0, 2], [-1, -1], [3, 1]])
    values, chosen = hook.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    assert chosen.tolist() == [[0, 2], [2, 0], [3, 1]]  # token 1 unknown: the router's own top-2
    assert torch.equal(values, scores.gather(1, chosen))
    assert hook.own.tolist() == [[3, 1], [2, 0], [1, 0]]
    hook.target = torch.tensor([[0, 2]])
    with pytest.raises(RouterReplayError, match=r"MoE layer 0 routes \(3, 2\) \[tokens, top_k\] here but was given"):
        hook.get_replay_topk(scores, 2, default_compute_topk=_default_topk)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_routing_follows_the_tokens_into_the_router_order_and_back(packed):
    """What a micro-batch's routers see, token by token, and what a recording puts back: the padded [b, S, L, k]."""
    replayer = RouterReplayer("train", _tcfg())
    batch = _batch()
    g = torch.Generator().manual_seed(0)
    routed = torch.randint(0, 8, (3, 5, 3, 2), generator=g)
    layout = pack(batch.tokens, [5, 3, 4], multiple=8) if packed else None
    local = replayer._to_local(routed + 1, layout) - 1
    if packed:  # the stream's tokens in order, then the tail padding (no routing known)
        assert torch.equal(local[:5], routed[0]) and torch.equal(local[5:8], routed[1, :3])
        assert torch.equal(local[8:12], routed[2, :4]) and bool((local[12:] == -1).all())
    else:  # megatron's [s, b] token order
        assert torch.equal(local[1], routed[1, 0]) and torch.equal(local[3], routed[0, 1])
    hooks = [_LayerReplay(j) for j in range(3)]
    for hook in hooks:
        hook.chosen = local[:, hook.moe_index].clamp_min(0)
    store = torch.full((4, 5, 3, 2), -1, dtype=torch.int32)
    replayer._keep(SimpleNamespace(hooks=hooks), store, [3, 0, 1], batch, layout)
    real = replayer._real(batch, None).view(5, 3).T  # [b, S]
    back = store[[3, 0, 1]]
    assert torch.equal(back[real], routed[real].to(torch.int32))
    assert bool((store[2] == -1).all())  # a row of another micro-batch: untouched
    if packed:
        assert bool((back[~real] == -1).all())  # padding is not in the stream: nothing routed it


def test_a_dense_model_is_refused_naming_the_key():
    with pytest.raises(RouterReplayError, match=r"^actor.router_replay=train needs a mixture-of-experts model"):
        RouterReplayer("train", _tcfg("qwen3"))
    RouterReplayer("none", _tcfg("qwen3"))  # off: nothing to check


def test_routed_experts_of_another_shape_or_range_are_refused_in_one_line():
    replayer = RouterReplayer("rollout", _tcfg())
    bad = _batch(torch.zeros(3, 5, 2, 2, dtype=torch.int16))  # 2 MoE layers where the model has 3
    with pytest.raises(RouterReplayError) as info:
        _run_pass(replayer, bad, "statistics")
    message = str(info.value)
    assert message.startswith("Sequences.routed_experts: expected integer expert ids of shape [3, 5, 3, 2]")
    assert "got torch.int16 [3, 5, 2, 2]" in message and "\n" not in message
    with pytest.raises(RouterReplayError, match=r"expert ids must lie in 0\.\.7"):
        _run_pass(replayer, _batch(torch.full((3, 5, 3, 2), 8)), "update")
    with pytest.raises(RouterReplayError, match="expected integer expert ids"):
        _run_pass(replayer, _batch(torch.zeros(3, 5, 3, 2)), "update")


def test_rollout_replay_needs_the_engines_ids_in_the_statistics_pass_and_the_update():
    replayer = RouterReplayer("rollout", _tcfg())
    for kind in ("statistics", "update"):
        with pytest.raises(RouterReplayError, match=r"^actor.router_replay=rollout: the batch carries no routed_"):
            _run_pass(replayer, _batch(), kind)


def test_layouts_replay_does_not_follow_are_refused_naming_the_keys():
    with pytest.raises(
        RouterReplayError, match=r"^actor.router_replay=rollout with actor.recompute=full needs actor.pp"
    ):
        RouterReplayer("rollout", _tcfg(pp=2, recompute="full"))
    RouterReplayer("rollout", _tcfg(recompute="full"))  # PP=1: the backward follows its own forward
