"""Routing replay in the Megatron actor (actor.router_replay), on a tiny Qwen3-MoE (8 experts, top-2, 3 MoE layers
and a dense one), fp32, 2 gloo processes, several micro-batches per rank.

- ``train``: the statistics pass records each token's top-k (equal to transformers' router on the same tokens), and
  the update routes every token exactly there, bit for bit, with ``moe/routing_mismatch`` 0; at EP=2 (DP=2),
  packed; at PP=2, packed; at DP=2, padded. With the routers perturbed between the passes the update still routes
  as recorded, and its log-prob mismatch to the statistics pass is lower with replay than without.
- ``rollout``: an "engine" (transformers with perturbed routers) gives its routing and log-probs; the actor's
  routing equals the engine's ids, its log-probs equal transformers' forward of the actor's own weights forced onto
  the engine's routing (relative <= 1e-5), and the mismatch to the engine's log-probs is lower with replay.

Needs the actor integration (the hooks of /work/replay-actor.patch in actor/megatron_actor.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.testing.configs import algo_config

pytestmark = pytest.mark.dist

REL = 1e-5
LENGTHS = [12, 7, 10, 5, 9, 11]
TEMPERATURE = 1.0


ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25]


def _targets():
    from megatron_rlvr.protocols import Targets

    return Targets(advantages=torch.tensor(ADVANTAGES))


def _batch(vocab: int, seed: int = 0, **fields):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(seed)
    b, s = len(LENGTHS), max(LENGTHS)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, 3 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask, **fields)


def _real() -> torch.Tensor:
    """[B, S] positions that belong to a sequence."""
    return torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]


def _perturb_routers(chunks, scale: float) -> None:
    """The same noise on every rank (routers are replicated) for each MoE layer's router weight."""
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                g = torch.Generator().manual_seed(1000 + module.layer_number)
                with torch.no_grad():
                    module.weight.add_(scale * torch.randn(module.weight.shape, generator=g))


def _actor(hf_dir: str, mode: str, pp: int, ep: int, pack: bool, micro_batch_size: int, **actor_overrides):
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig

    actor = MegatronActor(
        ModelConfig(hf_dir=hf_dir),
        ActorConfig(
            pp=pp,
            ep=ep,
            micro_batch_size=micro_batch_size,
            lr=1e-3,
            pack_sequences=pack,
            router_replay=mode,
            **actor_overrides,
        ),
        algo_config({"loss.kind": "casp", "loss.tau_q": 0.5}),
        temperature=TEMPERATURE,
        total_steps=2,
    )
    actor.replay.capture = True
    return actor


def _train_worker(
    hf_dir: str,
    pp: int,
    ep: int,
    pack: bool,
    perturb: float,
    micro_batch_size: int = 1,
    mini_batches: int = 1,
    **actor_overrides,
):
    from megatron_rlvr.runtime.distributed import model_parallel

    cp = actor_overrides.get("cp", 1)
    with model_parallel(tp=1, pp=pp, vpp=actor_overrides.get("vpp"), seed=11, ep=ep, etp=1, cp=cp):
        actor = _actor(hf_dir, "train", pp, ep, pack, micro_batch_size, **actor_overrides)
        batch = _batch(actor.vocab_size)
        statistics = actor.statistics_pass(batch)
        recorded = statistics.routed_experts.clone()
        if perturb:
            _perturb_routers(actor.model_chunks, perturb)
        metrics = actor.update(batch, _targets(), statistics, mini_batches=mini_batches)
        return recorded, torch.cat(actor.replay.captured[-mini_batches:]), metrics


def _reference_worker(hf_dir: str, noise: float):
    """The policy's routers perturbed before the statistics pass: the frozen reference (the initial weights)
    replays the routing the policy recorded."""
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=1, pp=1, seed=11, ep=2, etp=1):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(ep=2, micro_batch_size=2, lr=1e-3, router_replay="train"),
            algo_config({"loss.kind": "casp", "loss.tau_q": 0.5, "kl.coef": 0.1}),
            temperature=TEMPERATURE,
            total_steps=2,
        )
        _perturb_routers(actor.model_chunks, noise)
        statistics = actor.score(_batch(actor.vocab_size), [], mini_batches=1)  # a reference: a statistics pass
        return statistics.routed_experts, statistics.ref_logp


def _rollout_worker(hf_dir: str, pp: int, ep: int, routed: torch.Tensor, engine_logp: torch.Tensor, mbs: int):
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=1, pp=pp, seed=11, ep=ep, etp=1):
        actor = _actor(hf_dir, "rollout", pp, ep, True, mbs)
        batch = _batch(actor.vocab_size, routed_experts=routed, engine_logp=engine_logp)
        statistics = actor.statistics_pass(batch)
        assert statistics.routed_experts is None  # replayed the engine's: nothing recorded
        statistics_routing = actor.replay.captured[-1]
        statistics_metrics = actor.replay.metrics()
        metrics = actor.update(batch, _targets(), statistics, mini_batches=1)
        return statistics.old_logp, statistics_routing, statistics_metrics, metrics


# -- transformers as the reference -------------------------------------------------------------------------------
def _hf_model(hf_dir: str, router_noise: float = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if router_noise:
        # the megatron layer numbers of the MoE layers (1-based) seed the same noise as _perturb_routers
        numbers = [i + 1 for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        for number, block in zip(numbers, moe):
            g = torch.Generator().manual_seed(1000 + number)
            with torch.no_grad():
                block.gate.weight.add_(router_noise * torch.randn(block.gate.weight.shape, generator=g))
    return model, moe


@torch.no_grad()
def _hf_routing_and_logp(model, tokens: torch.Tensor, forced: torch.Tensor | None = None):
    """Per sequence (unpadded): the top-k ids of every MoE layer [B, S, L, k] (-1 past the end) and the log-probs
    [B, S - 1] at temperature 1; ``forced``: route every MoE layer onto those ids (the gate's own probabilities)."""
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    k = moe[0].gate.top_k
    routed = torch.full((*tokens.shape, len(moe), k), -1, dtype=torch.long)
    logp = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    originals = [block.gate.forward for block in moe]
    for i, n in enumerate(LENGTHS):
        if forced is not None:
            for j, block in enumerate(moe):
                block.gate.forward = _forced_gate(block.gate, forced[i, :n, j].long())
        try:
            out = model(tokens[i : i + 1, :n], output_router_logits=True)
        finally:
            for block, original in zip(moe, originals):
                block.gate.forward = original
        for j, logits in enumerate(out.router_logits):
            routed[i, :n, j] = torch.topk(logits.softmax(-1), k, dim=-1).indices
        lp = out.logits[0, :-1].log_softmax(-1).gather(-1, tokens[i, 1:n, None])[:, 0]
        logp[i, : n - 1] = lp
    return routed, logp


def _forced_gate(gate, ids: torch.Tensor):
    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, gate.weight)
        top = logits.softmax(-1, dtype=torch.float).gather(-1, ids)
        if gate.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), ids

    return forward


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("replay") / "moe", seed=51))


@pytest.mark.parametrize(
    "pp, ep, overrides",
    [(2, 1, {"vpp": 2}), (1, 2, {"recompute": "full"})],
    ids=["pp2-vpp2-interleaved", "ep2-recompute-full"],
)
def test_train_mode_replays_under_the_interleaved_schedule_and_full_recompute(workers2, moe_dir, pp, ep, overrides):
    """VPP: each rank holds two chunks, each with its own MoE layers; full recompute: the backward's recomputed
    forward routes as the forward did."""
    (recorded, update_routing, metrics), _ = workers2.run(_train_worker, moe_dir, pp, ep, True, 0.0, 1, 1, **overrides)
    real = _real()
    hf_routed, _ = _hf_routing_and_logp(_hf_model(moe_dir)[0], _batch(1001).tokens)
    assert bool(_same_sets(recorded[real].long(), hf_routed[real]).all())
    assert torch.equal(update_routing[real], recorded[real])
    print(f"{overrides}: {metrics}")
    assert metrics["moe/routing_mismatch"] == 0.0 and metrics["moe/logp_mismatch_replay"] == 0.0


@pytest.fixture(scope="module")
def moe_dir_dense_first(tmp_path_factory):
    """Layers 0 and 1 dense: at PP=2 the first stage holds no MoE layer."""
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    out = tmp_path_factory.mktemp("replay_dense_first") / "moe"
    return str(make_tiny_hf_model("qwen3_moe", out, seed=51, mlp_only_layers=[0, 1]))


def test_train_mode_at_pp2_with_a_stage_without_moe_layers(workers2, moe_dir_dense_first):
    (recorded, update_routing, metrics), _ = workers2.run(_train_worker, moe_dir_dense_first, 2, 1, True, 0.0)
    real = _real()
    assert recorded.shape == (len(LENGTHS), max(LENGTHS), 2, 2)
    hf_routed, _ = _hf_routing_and_logp(_hf_model(moe_dir_dense_first)[0], _batch(1001).tokens)
    assert bool(_same_sets(recorded[real].long(), hf_routed[real]).all())
    assert torch.equal(update_routing[real], recorded[real])
    assert metrics["moe/routing_mismatch"] == 0.0 and metrics["moe/logp_mismatch_replay"] == 0.0


@pytest.mark.parametrize(
    "pp, ep, pack, mini, cp",
    [(1, 2, True, 1, 1), (2, 1, True, 1, 1), (1, 1, False, 1, 1), (1, 2, True, 3, 1), (1, 1, True, 1, 2)],
    ids=["ep2-dp2-packed", "pp2-packed", "dp2-padded", "ep2-dp2-packed-3-mini-batches", "cp2-packed"],
)
def test_train_mode_update_routes_exactly_as_the_statistics_pass_recorded(workers2, moe_dir, pp, ep, pack, mini, cp):
    """With 3 mini-batches the later ones run after optimizer steps: their routers may choose otherwise (counted in
    moe/routing_mismatch), they still route as recorded. At CP=2 each rank routes its own chunks of every sequence:
    the ids follow the tokens into each rank's share of the stream and the record merges both shares."""
    results = workers2.run(_train_worker, moe_dir, pp, ep, pack, 0.0, 1, mini, cp=cp)
    (recorded, update_routing, metrics), other = results
    real = _real()
    assert recorded.shape == (len(LENGTHS), max(LENGTHS), 3, 2)
    assert torch.equal(recorded, other[0]) and torch.equal(update_routing, other[1])  # the same on every rank
    assert bool((recorded[real] >= 0).all())
    # what was recorded is each token's own routing: transformers' router on the same (unpadded) tokens
    hf_routed, _ = _hf_routing_and_logp(_hf_model(moe_dir)[0], _batch(1001).tokens)
    assert bool(_same_sets(recorded[real].long(), hf_routed[real]).all())
    assert torch.equal(update_routing[real], recorded[real])
    print(f"pp={pp} ep={ep} pack={pack} mini-batches={mini}: {metrics}")
    if mini == 1:
        assert metrics["moe/routing_mismatch"] == 0.0


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum())


NOISE = 0.05  # router weights (std 0.5) + NOISE * N(0, 1): about a fifth of the top-k sets change


def test_train_mode_replay_lowers_the_log_prob_mismatch_when_the_router_moves(workers2, moe_dir):
    """One micro-batch per rank (the comparison's sample is the whole batch), so the figures can be checked
    against transformers: the statistics pass is the model's own forward, the update's with replay is the
    perturbed model forced onto that routing, without replay the perturbed model's own forward."""
    (recorded, update_routing, metrics), _ = workers2.run(_train_worker, moe_dir, 1, 2, True, NOISE, 3)
    real, batch = _real(), _batch(1001)
    assert torch.equal(update_routing[real], recorded[real])  # replayed although the routers now choose otherwise
    own_routed, own_logp = _hf_routing_and_logp(_hf_model(moe_dir)[0], batch.tokens)
    moved = _hf_model(moe_dir, router_noise=NOISE)[0]
    _, replayed_logp = _hf_routing_and_logp(moved, batch.tokens, forced=own_routed)
    moved_routed, moved_logp = _hf_routing_and_logp(moved, batch.tokens)
    with_replay, without = metrics["moe/logp_mismatch_replay"], metrics["moe/logp_mismatch_no_replay"]
    print(
        f"router weights + {NOISE} N(0,1) between the passes: routing_mismatch {metrics['moe/routing_mismatch']:.4f}, "
        f"mean |dlogp| with replay {with_replay:.4e}, without {without:.4e} (transformers: "
        f"{_mean_abs(replayed_logp, own_logp, batch.response_mask):.4e}, "
        f"{_mean_abs(moved_logp, own_logp, batch.response_mask):.4e})"
    )
    assert with_replay == pytest.approx(_mean_abs(replayed_logp, own_logp, batch.response_mask), rel=1e-4)
    assert without == pytest.approx(_mean_abs(moved_logp, own_logp, batch.response_mask), rel=1e-4)
    assert 0 < with_replay < without
    assert metrics["moe/routing_mismatch"] > 0.05


@pytest.mark.parametrize("pp, ep, mbs", [(1, 2, 3), (2, 1, 6)], ids=["ep2-dp2", "pp2"])
def test_rollout_mode_routes_onto_the_engines_experts(workers2, moe_dir, pp, ep, mbs):
    """The "engine" is transformers with its routers perturbed: its routing and log-probs are the rollout's."""
    batch, real = _batch(1001), _real()
    mask = batch.response_mask
    engine_routed, engine_logp = _hf_routing_and_logp(_hf_model(moe_dir, router_noise=NOISE)[0], batch.tokens)
    engine_logp = engine_logp * mask
    own = _hf_model(moe_dir)[0]
    # the actor's weights forced onto the engine's routing; its own routers' choices at each layer of that forward
    own_under_replay, forced_logp = _hf_routing_and_logp(own, batch.tokens, forced=engine_routed)
    _, free_logp = _hf_routing_and_logp(own, batch.tokens)
    routed = torch.where(real[:, :, None, None], engine_routed, -1).to(torch.int16)  # -1 on padding, as collect
    results = workers2.run(_rollout_worker, moe_dir, pp, ep, routed, engine_logp, mbs)
    (old_logp, routing, statistics_metrics, metrics), other = results
    assert torch.equal(old_logp, other[0])
    assert torch.equal(routing[real].long(), engine_routed[real])
    rel = ((old_logp - forced_logp).abs() / forced_logp.abs().clamp_min(1e-12))[mask].max().item()
    expected_mismatch = 1 - float(_same_sets(own_under_replay[real], engine_routed[real]).double().mean())
    with_replay, without = metrics["moe/logp_mismatch_replay"], metrics["moe/logp_mismatch_no_replay"]
    print(
        f"pp={pp} ep={ep}: actor with replay vs transformers forced onto the engine's routing: max rel {rel:.2e}; "
        f"routing_mismatch {statistics_metrics['moe/routing_mismatch']:.4f} (transformers {expected_mismatch:.4f}); "
        f"mean |dlogp| to the engine with replay {with_replay:.4e}, without {without:.4e}"
    )
    assert rel <= REL
    assert statistics_metrics["moe/routing_mismatch"] == pytest.approx(expected_mismatch, abs=1e-9)
    assert statistics_metrics["moe/routing_mismatch"] > 0.05
    assert with_replay == pytest.approx(_mean_abs(forced_logp, engine_logp, mask), rel=1e-4)
    assert without == pytest.approx(_mean_abs(free_logp, engine_logp, mask), rel=1e-4)
    assert 0 < with_replay < without


def test_train_mode_reference_replays_the_policys_recorded_routing(workers2, moe_dir):
    """The reference's log-probs are transformers' forward of the initial weights forced onto the routing the
    (perturbed) policy recorded, not its own forward."""
    (recorded, ref_logp), _ = workers2.run(_reference_worker, moe_dir, NOISE)
    batch, real = _batch(1001), _real()
    moved_routed, _ = _hf_routing_and_logp(_hf_model(moe_dir, router_noise=NOISE)[0], batch.tokens)
    assert bool(_same_sets(recorded[real].long(), moved_routed[real]).all())
    own = _hf_model(moe_dir)[0]
    _, forced_logp = _hf_routing_and_logp(own, batch.tokens, forced=recorded.long().clamp_min(0))
    _, free_logp = _hf_routing_and_logp(own, batch.tokens)
    mask = batch.response_mask
    rel = ((ref_logp - forced_logp).abs() / forced_logp.abs().clamp_min(1e-12))[mask].max().item()
    print(f"reference replaying the policy's routing vs transformers forced onto it: max rel {rel:.2e}")
    assert rel <= REL
    assert (ref_logp - free_logp).abs()[mask].max() > 1e-3  # its own routing would give other log-probs


def test_full_recompute_replays_in_the_backward_too(workers2, moe_dir):
    """Routers perturbed between the passes, so the own routing differs from the recorded one: the gradient with
    full recompute (the backward re-runs each layer's forward) equals the one without."""
    (_, _, plain), _ = workers2.run(_train_worker, moe_dir, 1, 2, True, NOISE, 3)
    (_, routing, recomputed), _ = workers2.run(_train_worker, moe_dir, 1, 2, True, NOISE, 3, 1, recompute="full")
    print(
        f"grad_norm without / with full recompute: {plain['actor/grad_norm']:.8g} / {recomputed['actor/grad_norm']:.8g}"
    )
    assert recomputed["moe/routing_mismatch"] > 0.05
    assert recomputed["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=REL)
    assert recomputed["actor/loss"] == pytest.approx(plain["actor/loss"], rel=REL)
