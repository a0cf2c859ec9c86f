"""Context parallelism (docs/context-parallel.md): the load-balanced split of packed streams, and the actor at CP = 2
against CP = 1, at (CP, TP) = (2, 1) on 2 processes vs (1, 1) on one, and (2, 2) on 4 vs (1, 2) on 2, and on 4
processes also CP x PP = 2 (with and without virtual pipeline stages) and CP x DP = 2 (the same DP size on both sides; sequence parallelism does not run on
CPU: megatron's local spec refuses it): the
statistics passes (policy, entropy, reference), every loss x aggregation, rollout correction at token and sequence
level, PBA's per-sequence KL coefficient and the KL term give the same loss, metrics and full gradients (fp32,
relative 1e-5), on a batch with lengths 1, lengths not divisible by 4 and one sequence longer than the rest combined;
and the teacher's pass (distillation) at CP = 2 equals CP = 1."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_rlvr.actor.packing import context_parallel_index, cp_padded_length, pack, stream_tokens, unpack
from megatron_rlvr.testing.configs import algo_config
from tests.integration.actor.test_packing import (  # the same loss grid as the packing equality tests
    AGGS,
    LOSSES,
    RTOL,
    SEQ_KL,
)

LENGTHS = [61, 1, 7, 13, 2, 9, 1, 5]  # 61 > the other 38 together; 1s; 7, 13, 9, 5 not multiples of 4
BUDGET = 16  # tokens per CP rank per micro-batch
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.3, 1.0, -0.7, 0.3]


# ---------------------------------------------------------------------------------------------------------------
# The split (no processes)


def test_split_keeps_chunks_r_and_2cp_minus_1_minus_r_with_true_positions():
    tokens = torch.arange(100, 100 + 3 * 9).view(3, 9)
    lengths = [9, 1, 6]  # padded to 12, 4, 8 at cp = 2
    whole = [pack(tokens, lengths, cp=2, cp_rank=r) for r in range(2)]
    assert whole[0].cu_seqlens.tolist() == [0, 12, 16, 24] and whole[0].max_seqlen == 12
    assert [cp_padded_length(n, 2) for n in lengths] == [12, 4, 8] and stream_tokens(lengths, cp=2) == 24
    # sequence 0: chunks of 3, rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert whole[0].position_ids[0].tolist() == [0, 1, 2, 9, 10, 11, 0, 3, 0, 1, 6, 7]
    assert whole[1].position_ids[0].tolist() == [3, 4, 5, 6, 7, 8, 1, 2, 2, 3, 4, 5]
    assert whole[0].tokens[0].tolist() == [100, 101, 102, 0, 0, 0, 109, 0, 118, 119, 0, 0]
    assert whole[0].token_rows.tolist() == [0, 0, 0, -1, -1, -1, 1, -1, 2, 2, -1, -1]
    assert context_parallel_index(whole[0].cu_seqlens, 2, 1).tolist()[:6] == [3, 4, 5, 6, 7, 8]
    # each rank's stream, gathered rank after rank, unpacks to the CP = 1 view
    flat = pack(tokens, lengths)
    expected = unpack(flat.tokens[0].float(), flat, (3, 8))
    gathered = torch.cat([w.tokens[0] for w in whole]).float()
    assert torch.equal(unpack(gathered, whole[0], (3, 8)), expected)
    # to_stream is the inverse on each rank's own positions; gather follows tokens into each rank's stream
    for w in whole:
        assert torch.equal(w.to_stream(expected), torch.where(w.has_target, w.tokens[0], 0).float())
        assert torch.equal(w.gather(tokens[..., None])[:, 0], w.tokens[0])
    # a tail to a multiple of tp (sequence parallelism) per rank: the whole stream to 2 * cp * tp
    tail = pack(tokens, lengths, multiple=2, cp=2, cp_rank=1)
    assert tail.cu_seqlens.tolist() == [0, 12, 16, 24] and tail.num_tokens == 12
    assert pack(tokens, [9, 1, 5], multiple=2, cp=2).cu_seqlens.tolist() == [0, 12, 16, 24]
    assert pack(tokens, [9, 1, 1], multiple=2, cp=2).cu_seqlens.tolist() == [0, 12, 16, 20, 24]


def test_cp_attention_calls_cover_each_query_once_against_its_causal_keys():
    from megatron_rlvr.runtime.cpu.cp_attention import _calls

    cu = [0, 64, 68, 76, 80]  # one long sequence (chunks of 16), then short ones grouped
    for rank in range(2):
        calls = _calls(tuple(cu), 2, rank, block_tokens=8)
        covered = sorted(i for q0, n, *_ in calls for i in range(q0, q0 + n))
        assert covered == list(range(40))
        first, second = calls[0], calls[1]
        assert (first[2], first[3]) == (0, 16 * (rank + 1)) and (second[2], second[3]) == (0, 16 * (4 - rank))


# ---------------------------------------------------------------------------------------------------------------
# The actor: CP = 2 against CP = 1


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if n >= 2:
            mask[i, min(3, n - 1) - 1 : n - 1] = True
    return mask


def _batch(vocab: int):
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    tokens = torch.randint(0, vocab, (len(LENGTHS), width), generator=g)
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return rollouts(tokens, _mask(LENGTHS, width - 1))


def _valid(width: int) -> torch.Tensor:
    return torch.arange(width)[None] < (torch.tensor(LENGTHS)[:, None] - 1)


def _configs(full: bool) -> list[dict]:
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
    every += [
        {"loss.kind": "grpo", "rollout_correction.kind": "tis", "rollout_correction.cap": 1.5},
        {
            "loss.kind": "casp",
            "loss.tau_q": 0.5,
            "rollout_correction.kind": "mis",
            "rollout_correction.level": "sequence",
        },
        {
            "loss.kind": "casp",
            "loss.tau_q": 0.5,
            "seq_kl": True,
            "loss.candidates": "adaptive",
            "loss.candidate_mass": 0.01,
        },
        {"loss.kind": "grpo", "kl.coef": 0.1, "loss.agg": "seq_mean_token_mean"},
    ]
    if full:
        return every
    # 4 processes on 2 cores: one case per aggregation, the sequence-level correction, PBA and the KL term
    return [every[0], every[4], every[3 * LOSSES.index("kl_cov") + 2], *every[-4:]]


def _layout_numbers(hf_dir: str, tp: int, cp: int, configs: list[dict], pp: int = 1, vpp: int | None = None):
    """This rank's statistics, and per case the update's metrics and full gradients, at (TP, CP, PP, VPP)."""
    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.protocols import Statistics, Targets
    from megatron_rlvr.runtime.distributed import model_parallel

    with model_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp, seed=11):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir, packed_attention_block_tokens=8),  # long and grouped paths both
            ActorConfig(
                tp=tp,
                pp=pp,
                vpp=vpp,
                cp=cp,
                lr=0.0,
                max_tokens_per_micro_batch=BUDGET,
                use_distributed_optimizer=False,
            ),
            algo_config({"kl.coef": 0.1}),
            temperature=0.9,
            total_steps=2,
        )
        batch = _batch(actor.vocab_size)
        stats = (actor.compute_old_logp(batch), actor.compute_entropy(batch), actor.compute_ref_logp(batch))
        g = torch.Generator().manual_seed(1)
        old = stats[0] + 0.3 * torch.randn(stats[0].shape, generator=g)
        statistics = Statistics(old_logp=old, ref_logp=stats[2])
        batch = dataclasses.replace(batch, engine_logp=stats[0] + 0.2 * torch.randn(old.shape, generator=g))
        runs = []
        # the same micro-batches at both layouts (3 sequences each), so that per-micro-batch monitoring subsets
        # (the high-entropy tokens) compare too; then token budgets, which plan per CP rank (other bins)
        for budget, kwargs in [(0, c) for c in configs] + [(BUDGET, c) for c in configs[:2]]:
            # (4 under the interleaved schedule: 2 micro-batches, a multiple of pp)
            actor.cfg.max_tokens_per_micro_batch, actor.cfg.micro_batch_size = budget, 4 if vpp else 3
            kwargs = dict(kwargs)
            seq_kl = kwargs.pop("seq_kl", False)
            actor.algo_cfg = algo_config({**kwargs})
            targets = Targets(advantages=torch.tensor(ADVANTAGES), kl_coef=torch.tensor(SEQ_KL) if seq_kl else None)
            metrics = actor.update(batch, targets, statistics, mini_batches=1)
            grads = torch.cat([p.main_grad.reshape(-1).clone() for c in actor.model for p in c.module.parameters()])
            runs.append((metrics, grads))
        return stats, runs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _counterpart(rank: int, tp: int, dp: int, cp: int = 2) -> int:
    """The CP = 1 rank holding the same weights and data as ``rank`` of the CP = 2 layout (megatron's rank order
    tp-cp-ep-dp-pp: TP innermost, then CP, DP, PP)."""
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def _check(cp2_ranks, cp1_ranks, configs: list[dict], tp: int = 1, dp: int = 1) -> float:
    """Every rank of the CP = 2 layout against its CP = 1 counterpart, at the same DP size (DP averages of the
    monitoring means are means of per-rank means; this batch splits over DP alike at both layouts)."""
    worst = 0.0
    valid = _valid(max(LENGTHS) - 1)
    for rank, (cp2_stats, cp2_runs) in enumerate(cp2_ranks):
        cp1_stats, cp1_runs = cp1_ranks[_counterpart(rank, tp, dp)]
        for a, b in zip(cp2_stats, cp1_stats):
            worst = max(worst, _rel(a[valid], b[valid]))
            assert _rel(a[valid], b[valid]) <= RTOL
        cases = [(0, c) for c in configs] + [(BUDGET, c) for c in configs[:2]]
        assert len(cp2_runs) == len(cp1_runs) == len(cases)
        for (budget, case), (m2, g2), (m1, g1) in zip(cases, cp2_runs, cp1_runs):
            m2 = dict(m2)
            if budget:  # other micro-batches: the monitoring subsets chosen per micro-batch differ
                m1 = {k: v for k, v in m1.items() if "high_entropy" not in k}
                m2 = {k: v for k, v in m2.items() if "high_entropy" not in k}
            assert 0 < m2.pop("actor/cp_padding") < 1 and "actor/cp_padding" not in m1, case
            assert sorted(m2) == sorted(m1), case
            assert abs(m1["actor/loss"]) > 0 and float(g1.abs().max()) > 0, case  # the comparison means something
            rel = _rel(g2, g1)
            metric = max(abs(m2[k] - m1[k]) / max(abs(m1[k]), 1e-3) for k in m1)
            worst = max(worst, rel, metric)
            assert rel <= RTOL, f"{case}: gradient relative difference {rel:.2e}"
            assert metric <= RTOL, f"{case}: metric relative difference {metric:.2e}"
    return worst


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen"), seed=3))


@pytest.fixture(scope="module")
def workers1():
    from megatron_rlvr.testing.workers import WorkerGroup

    with WorkerGroup(1, timeout_s=600) as group:
        yield group


@pytest.mark.dist
@pytest.mark.slow
def test_cp2_equals_cp1_on_two_processes(workers1, workers2, tiny_qwen):
    configs = _configs(full=True)
    cp2 = workers2.run(_layout_numbers, tiny_qwen, 1, 2, configs, timeout_s=900)
    cp1 = workers1.run(_layout_numbers, tiny_qwen, 1, 1, configs, timeout_s=900)
    worst = _check(cp2, cp1, configs)
    print(f"cp=2 vs cp=1: {len(configs)} cases, max relative difference {worst:.2e}")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,vpp", [(2, 1, 1, None), (1, 2, 1, None), (1, 2, 1, 2), (1, 1, 2, None)])
def test_cp2_equals_cp1_on_four_processes(workers2, workers4, tiny_qwen, tp, pp, dp, vpp):
    """CP = 2 x TP = 2 (the Show list's), and CP with PP (variable lengths), with the interleaved schedule (one
    stream shape, the whole stream's) and with DP (gradients over DP x CP)."""
    configs = _configs(full=False)
    cp2 = workers4.run(_layout_numbers, tiny_qwen, tp, 2, configs, pp, vpp, timeout_s=900)
    cp1 = workers2.run(_layout_numbers, tiny_qwen, tp, 1, configs, pp, vpp, timeout_s=900)
    worst = _check(cp2, cp1, configs, tp, dp)
    print(
        f"cp=2 x (tp, pp, dp, vpp)=({tp}, {pp}, {dp}, {vpp}) vs cp=1: {len(configs)} cases, max relative difference {worst:.2e}"
    )
