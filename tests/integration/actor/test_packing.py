"""Packed sequences and token-budget micro-batches: the plan (balanced DP split, budgets, equal micro-batch counts),
the THD layout, and the actor's packed path against its padded path at (TP, PP, DP) = (1,1,1), (2,1,1), (1,2,1),
(1,1,2) for every loss and aggregation (also PBA's per-sequence KL coefficient and CaSP's adaptive candidates):
same loss, gradients and metrics (fp32, relative 1e-5), on a batch with lengths 1 .. the budget, one sequence over
the budget (it gets a micro-batch of its own) and sequences of length 1.
Also: the update without a statistics pass (old log-probs = its own, detached) equals the one after it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_rlvr.actor.packing import (
    balanced_split,
    mini_batch_rows,
    pack,
    plan_micro_batches,
    sequence_lengths,
    unpack,
)
from megatron_rlvr.testing.configs import algo_config

pytestmark = pytest.mark.dist

LENGTHS = [24, 1, 20, 2, 9, 1, 13, 5]  # one over the budget, the budget itself, length-1 sequences
BUDGET = 20
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.0, 1.0, -0.7, 0.3]
LOSSES = (
    "grpo",
    "casp",
    "entropy_bonus",
    "entropy_adv",
    "kl_cov",
    "clip_cov",
    "w_reinforce",
    "psr",
    "nsr",
    "forking_tokens",
)
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RTOL = 1e-5
SEQ_KL = [0.1, 0.0, 0.2, 0.0, 0.05, 0.1, 0.0, 0.3]


# ---------------------------------------------------------------------------------------------------------------
# The plan and the layout (no processes)


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    """Prompt of min(3, n - 1) tokens, the rest response; a length-1 sequence has no response token."""
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if n >= 2:
            mask[i, min(3, n - 1) - 1 : n - 1] = True
    return mask


def test_sequence_lengths_end_at_the_last_response_token():
    assert sequence_lengths(_mask(LENGTHS, max(LENGTHS) - 1)) == LENGTHS


def test_mini_batches_are_consecutive_rows_that_cover_the_batch():
    assert mini_batch_rows(8, 2) == [slice(0, 4), slice(4, 8)]
    assert mini_batch_rows(8, 1) == [slice(0, 8)]
    assert mini_batch_rows(9, 2) == [slice(0, 4), slice(4, 9)]  # every row in one, sizes one apart
    with pytest.raises(ValueError, match="mini_batches: expected >= 1"):
        mini_batch_rows(8, 0)
    with pytest.raises(ValueError, match="a batch of 3 sequences cannot fill 4 mini-batches"):
        mini_batch_rows(3, 4)


def test_balanced_split_gives_equal_counts_and_balanced_tokens():
    lengths = [100, 1, 1, 1, 90, 5, 3, 80, 2, 2, 70, 1]
    parts = balanced_split(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert [len(p) for p in parts] == [4, 4, 4]
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # the longest-first greedy bound
    strided = [sum(lengths[i::3]) for i in range(3)]  # the old split: every dp-th sequence
    assert max(loads) == 152 < max(strided) == 241  # two of the four long ones must share a rank: 80 + 70 + 1 + 1
    with pytest.raises(ValueError, match="does not split over data-parallel size 5"):
        balanced_split(lengths, 5)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_plan_respects_the_budget_with_equal_micro_batch_counts(dp):
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(1, 40, (32,), generator=g)] + [55, 70, 1, 1, 1, 1, 1, 1]
    plan = plan_micro_batches(lengths, dp, micro_batch_size=1, max_tokens=40)
    assert len({len(share) for share in plan}) == 1  # the same micro-batch count on every DP rank
    assert sorted(i for share in plan for m in share for i in m) == list(range(len(lengths)))
    for share in plan:
        for m in share:
            assert m
            assert sum(lengths[i] for i in m) <= 40 or len(m) == 1  # only an over-long sequence exceeds it, alone
    alone = [m for share in plan for m in share if any(lengths[i] > 40 for i in m)]
    assert sorted(len(m) for m in alone) == [1, 1]


def test_plan_rounds_the_micro_batch_count_to_a_multiple():
    plan = plan_micro_batches([5, 5, 5, 5, 5, 5], 1, micro_batch_size=1, max_tokens=100, count_multiple=4)
    assert len(plan[0]) == 4
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        plan_micro_batches([5, 5, 5], 1, micro_batch_size=1, max_tokens=100, count_multiple=4)


def test_attention_blocks_group_short_sequences_and_leave_long_ones_alone():
    from megatron_rlvr.runtime.cpu.attention import _blocks

    bounds = [0, 100, 150, 160, 400, 700, 701, 702]  # lengths 100, 50, 10, 240, 300, 1, 1
    assert _blocks(bounds) == [(0, 160, [100, 50, 10]), (160, 400, [240]), (400, 700, [300]), (700, 702, [1, 1])]


def test_the_block_bound_reaches_the_attention_through_the_layer_spec():
    """model.packed_attention_block_tokens: the local spec builds the packed attention with that bound."""
    from megatron_rlvr.models.builder import layer_spec

    core = layer_spec(use_te=False, core_attention="unfused", block_tokens=8).submodules.self_attention.submodules
    assert core.core_attention.module.__name__ == "PackedDotProductAttention"
    assert core.core_attention.params == {"block_tokens": 8}
    assert (
        layer_spec(use_te=False, core_attention="unfused").submodules.self_attention.submodules.core_attention.__name__
        == "PackedDotProductAttention"
    )


def test_plan_by_count_keeps_micro_batch_size():
    plan = plan_micro_batches(LENGTHS, 2, micro_batch_size=3)
    assert [[len(m) for m in share] for share in plan] == [[3, 1], [3, 1]]


def test_pack_lays_sequences_end_to_end_and_unpack_puts_values_back():
    tokens = torch.arange(100, 100 + 3 * 6).view(3, 6)
    layout = pack(tokens, [4, 1, 6], multiple=4)  # 11 tokens -> 12: a padding segment of 1
    assert layout.cu_seqlens.tolist() == [0, 4, 5, 11, 12] and layout.cu_seqlens.dtype == torch.int32
    assert layout.max_seqlen == 6 and layout.real_tokens == 11 and layout.num_tokens == 12
    assert layout.tokens[0].tolist() == [100, 101, 102, 103, 106, 112, 113, 114, 115, 116, 117, 0]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0]
    # position t predicts token t + 1 of the same sequence; nothing after a sequence's last token
    assert layout.targets[0].tolist() == [101, 102, 103, 0, 0, 113, 114, 115, 116, 117, 0, 0]
    view = unpack(layout.tokens[0].float().requires_grad_(), layout, (3, 5))
    expected = torch.zeros(3, 5)
    expected[0, :3] = torch.tensor([100.0, 101, 102])
    expected[2, :5] = torch.tensor([112.0, 113, 114, 115, 116])
    assert torch.equal(view.detach(), expected)  # [b, S - 1]: every statistic back at its padded position


def test_pack_to_a_fixed_total_pads_the_tail_and_rejects_a_total_too_small():
    tokens = torch.arange(100, 100 + 3 * 6).view(3, 6)
    layout = pack(tokens, [4, 1, 6], multiple=2, total=16)  # the interleaved schedule's one stream shape
    assert layout.cu_seqlens.tolist() == [0, 4, 5, 11, 16] and layout.num_tokens == 16 and layout.real_tokens == 11
    assert torch.equal(layout.targets[0, :11], pack(tokens, [4, 1, 6]).targets[0])
    with pytest.raises(ValueError, match="total=10: expected a multiple of 2 of at least the 11 tokens packed"):
        pack(tokens, [4, 1, 6], multiple=2, total=10)
    with pytest.raises(ValueError, match="total=13"):
        pack(tokens, [4, 1, 6], multiple=2, total=13)


# ---------------------------------------------------------------------------------------------------------------
# The actor: packed against padded


def _batch(vocab: int):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    tokens = torch.randint(0, vocab, (len(LENGTHS), width), generator=g)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return rollouts(tokens, _mask(LENGTHS, width - 1))


def _valid(width: int) -> torch.Tensor:
    """Positions with a target inside the sequence: where packed and padded must agree."""
    return torch.arange(width)[None] < (torch.tensor(LENGTHS)[:, None] - 1)


def _grads(actor) -> torch.Tensor:
    return torch.cat([p.main_grad.reshape(-1).clone() for c in actor.model for p in c.module.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _metric_diff(a: dict[str, float], b: dict[str, float]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-3) for k in a)


def _update(actor, batch, algo_kwargs: dict, *, pack: bool, budget: int, mbs: int, old_logp, ref_logp=None):
    """One update at lr = 0 (the weights stay, so one actor serves every case): its metrics and gradients."""
    from megatron_rlvr.protocols import Statistics, Targets

    actor.cfg.pack_sequences, actor.cfg.max_tokens_per_micro_batch, actor.cfg.micro_batch_size = pack, budget, mbs
    kwargs = dict(algo_kwargs)
    seq_kl = kwargs.pop("seq_kl", False)  # PBA's per-sequence KL coefficient travels with its rows
    actor.algo_cfg = algo_config({**kwargs})
    targets = Targets(advantages=torch.tensor(ADVANTAGES), kl_coef=torch.tensor(SEQ_KL) if seq_kl else None)
    metrics = actor.update(batch, targets, Statistics(old_logp=old_logp, ref_logp=ref_logp), mini_batches=1)
    return metrics, _grads(actor)


def _layout_numbers(hf_dir: str, tp: int, pp: int, configs: list[dict], count_configs: list[dict]):
    """Max relative differences packed vs padded, per case, on this rank."""
    return _compare(hf_dir, tp, pp, configs, count_configs)


def _compare(hf_dir: str, tp: int, pp: int, configs: list[dict], count_configs: list[dict]) -> dict[str, float]:
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, seed=11):
        actor = MegatronActor(
            # blocks of at most 8 tokens: short sequences share a dense block, longer ones are blocks alone (both paths)
            ModelConfig(hf_dir=hf_dir, packed_attention_block_tokens=8),
            ActorConfig(tp=tp, pp=pp, lr=0.0),
            algo_config({"kl.coef": 0.1}),
            temperature=0.9,
            total_steps=2,
        )
        batch = _batch(actor.vocab_size)
        valid = _valid(batch.response_mask.shape[1])
        out: dict[str, float] = {}
        per_token = {}
        for pack in (False, True):
            actor.cfg.pack_sequences, actor.cfg.max_tokens_per_micro_batch = pack, BUDGET
            per_token[pack] = (
                actor.compute_old_logp(batch),
                actor.compute_entropy(batch),
                actor.compute_ref_logp(batch),
            )
        for name, a, b in zip(("old_logp", "entropy", "ref_logp"), per_token[True], per_token[False]):
            out[f"stats/{name}"] = _rel(a[valid], b[valid])
            out[f"stats/{name}/shape"] = float(a.shape != b.shape)
        # old log-probs off the current policy, so ratios differ from 1 and some tokens are clipped
        g = torch.Generator().manual_seed(1)
        old = per_token[False][0] + 0.3 * torch.randn(per_token[False][0].shape, generator=g)
        ref = per_token[False][2]
        engine = dataclasses.replace(batch, engine_logp=per_token[False][0] + 0.2 * torch.randn(old.shape, generator=g))
        for budget, mbs, cases in ((BUDGET, 1, configs), (0, 3, count_configs)):
            for kwargs in cases:
                key = f"budget={budget} mbs={mbs} " + " ".join(f"{k}={v}" for k, v in kwargs.items())
                (m0, g0), (m1, g1) = (
                    _update(actor, engine, kwargs, pack=p, budget=budget, mbs=mbs, old_logp=old, ref_logp=ref)
                    for p in (False, True)
                )
                out[f"{key}/grad"] = _rel(g1, g0)
                out[f"{key}/metrics"] = _metric_diff(m1, m0)
                out[f"{key}/loss_nonzero"] = float(abs(m0["actor/loss"]) > 0 and float(g0.abs().max()) > 0)
                if "candidate_mass" in kwargs:  # the adaptive sets differ from the fixed top-N on this batch
                    out[f"{key}/loss_nonzero"] *= float(1 < m0["loss/casp_candidates"] < 3)
        # exactly on-policy: no statistics pass, the update's own detached log-probs are the old ones
        on_policy = {"loss.kind": "casp", "loss.tau_q": 0.5}
        actor.reference = None  # needs_statistics_pass: not with a reference model
        assert not actor.needs_statistics_pass(1) and actor.needs_statistics_pass(2)
        for pack in (False, True):
            stats = per_token[pack][0]
            m0, g0 = _update(actor, batch, on_policy, pack=pack, budget=BUDGET, mbs=1, old_logp=stats)
            m1, g1 = _update(actor, batch, on_policy, pack=pack, budget=BUDGET, mbs=1, old_logp=None)
            out[f"skip pack={pack}/grad"] = _rel(g1, g0)
            out[f"skip pack={pack}/metrics"] = _metric_diff(m1, m0)
            # the update's own old log-probs against the statistics pass's, read from the mismatch metric it reports
            # with the statistics pass's log-probs as the engine's: mean |own - statistics| over the trained tokens
            stats_as_engine = dataclasses.replace(batch, engine_logp=stats)
            m2, _ = _update(actor, stats_as_engine, on_policy, pack=pack, budget=BUDGET, mbs=1, old_logp=None)
            out[f"skip pack={pack}/old_logp"] = m2["rollout/logp_mismatch"] / float(stats[valid].abs().max())
        return out


def _configs() -> tuple[list[dict], list[dict]]:
    every = [
        {
            "loss.kind": loss,
            "loss.agg": agg,
            "loss.tau_q": 0.5,
            "loss.cov_fraction": 0.2,
            "loss.max_len_norm": 16,
            "kl.coef": 0.05 if i % 4 == 0 else 0.0,
        }
        for i, (loss, agg) in enumerate(itertools.product(LOSSES, AGGS))
    ]
    # the engine's log-probs reach the loss (rollout correction), at token and at sequence level
    every += [
        {"loss.kind": "grpo", "rollout_correction.kind": "tis", "rollout_correction.cap": 1.5},
        {
            "loss.kind": "casp",
            "loss.tau_q": 0.5,
            "rollout_correction.kind": "mis",
            "rollout_correction.level": "sequence",
        },
        # PBA's per-sequence KL coefficient; CaSP's adaptive candidates (the tiny model's top-3 hold ~1.5% of
        # the probability, so a 1% share gives sets of every size)
        {
            "loss.kind": "casp",
            "loss.tau_q": 0.5,
            "seq_kl": True,
            "loss.candidates": "adaptive",
            "loss.candidate_mass": 0.01,
        },
    ]
    few = [every[0], every[4], every[3 * LOSSES.index("kl_cov") + 2]]
    return every, few


@pytest.fixture(scope="module")
def workers1():
    from megatron_rlvr.testing.workers import WorkerGroup

    with WorkerGroup(1, timeout_s=300) as group:
        yield group


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=3))


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_packed_path_equals_padded_path(request, tiny_qwen, tp, pp, dp):
    group = request.getfixturevalue("workers1" if tp * pp * dp == 1 else "workers2")
    every, few = _configs()
    results = group.run(_layout_numbers, tiny_qwen, tp, pp, every, few)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    assert len([k for k in worst if k.endswith("/grad")]) == len(every) + len(few) + 2
    compared = {k: v for k, v in worst.items() if not k.endswith(("/shape", "/loss_nonzero"))}
    print(
        f"tp={tp} pp={pp} dp={dp}: {len(compared)} comparisons, max relative difference "
        f"{max(compared.values()):.2e} ({max(compared, key=compared.get)})"
    )
    for key, value in worst.items():
        if key.endswith("/shape"):
            assert value == 0, key
        elif key.endswith("/loss_nonzero"):
            # the comparison means something: every case has a loss and a gradient (on some rank)
            assert max(r[key] for r in results) == 1.0, key
        else:
            assert value <= RTOL, f"{key}: relative difference {value:.2e} (tp={tp} pp={pp} dp={dp})"


def test_gather_puts_a_per_token_field_into_stream_order_with_zeros_at_padding():
    tokens = torch.arange(12).reshape(3, 4) + 1
    layout = pack(tokens, [2, 4, 1], multiple=4)
    field = torch.stack([tokens * 10, tokens * 10 + 1], dim=-1)  # [b, S, 2]
    out = layout.gather(field)
    assert out.shape == (layout.num_tokens, 2)
    assert torch.equal(out[: layout.real_tokens, 0], layout.tokens[0, : layout.real_tokens] * 10)
    assert torch.equal(out[layout.real_tokens :], torch.zeros(layout.num_tokens - layout.real_tokens, 2).long())
