"""The probe's per-position statistics against a dense float64 computation: one process holding the whole vocabulary,
and the vocabulary sharded over two gloo ranks (padded ids in the last shard), where E_K is summed per shard and
all-reduced; the limits the paper's appendix B.2 states; the intervals and verdicts of the mechanism study."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rlvr.eval.bootstrap import Interval, IntervalSpec
from megatron_rlvr.inspection import mechanism_stats as ms
from megatron_rlvr.inspection.probe_stats import check_ks, position_stats

KS = (1, 8, 64)


def dense_reference(logits: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float, ks=KS) -> dict:
    """Every statistic in float64 from the whole [T, V] logits (ids >= vocab are padding)."""
    z = logits[:, :vocab].to(torch.float64) / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    top = p.sort(dim=-1, descending=True).values[:, :3]
    return {
        "logp": logp.gather(1, targets[:, None])[:, 0],
        "entropy": -(p * logp).sum(-1),
        "top_prob": top,
        "distinct": torch.stack([(1 - (1 - p) ** k).sum(-1) for k in ks], dim=-1),
    }


def _logits(tokens: int, vocab: int, padded: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.3, 6.0, tokens)[:, None]  # from flat to peaked rows
    logits = torch.randn(tokens, padded, generator=g) * scale
    logits[:, vocab:] = 50.0  # padded ids carry the largest logits: they must never count
    return logits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_every_statistic_equals_the_dense_float64_computation(dtype, temperature):
    vocab, padded = 301, 320
    logits = _logits(24, vocab, padded).to(dtype)
    targets = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(1))
    got = position_stats(logits, targets, KS, vocab_size=vocab, temperature=temperature, scratch_bytes=8 * 301 * 5)
    want = dense_reference(logits, targets, vocab, temperature)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for name in want:
        torch.testing.assert_close(getattr(got, name), want[name], **tol, msg=name)
    one = 1e-12 if dtype == torch.float64 else 1e-6  # fp32: log Z from the op's float32 rank-1 log-prob
    assert got.distinct[:, 0].tolist() == pytest.approx([1.0] * 24, abs=one)  # one draw: one distinct token


def test_distinct_goes_to_one_as_rank1_goes_to_one_and_to_k_on_a_flat_distribution():
    vocab = 1000
    peaks = torch.tensor([0.0, 5.0, 10.0, 20.0, 40.0], dtype=torch.float64)
    logits = torch.zeros(len(peaks), vocab, dtype=torch.float64)
    logits[:, 7] = peaks
    got = position_stats(logits, torch.zeros(len(peaks), dtype=torch.long), (8, 64))
    p1 = got.top_prob[:, 0]
    assert p1.diff().gt(0).all() and p1[-1] > 1 - 1e-12
    assert got.distinct.diff(dim=0).lt(0).all()  # E_K falls as rank 1 grows
    assert got.distinct[-1].tolist() == pytest.approx([1.0, 1.0], abs=1e-9)  # appendix B.2's limit
    for j, k in enumerate((8, 64)):  # between 1 and min(K, 1 + K (1 - p1)) everywhere
        assert (got.distinct[:, j] <= torch.minimum(torch.tensor(float(k)), 1 + k * (1 - p1)) + 1e-9).all()
    flat = [vocab * (1 - (1 - 1 / vocab) ** k) for k in (8, 64)]  # uniform over V ids
    assert got.distinct[0].tolist() == pytest.approx(flat, rel=1e-12)


def _sharded_stats(logits, targets, vocab, temperature):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local = logits.shape[1] // world
    shard = logits[:, rank * local : (rank + 1) * local].contiguous()
    got = position_stats(
        shard, targets, KS, group=dist.group.WORLD, vocab_start=rank * local, vocab_size=vocab, temperature=temperature
    )
    return {name: getattr(got, name) for name in got._fields}


@pytest.mark.dist
def test_vocab_sharded_over_two_ranks_equals_the_dense_computation(workers2):
    vocab, padded = 301, 320  # the second shard holds ids 160..319, of which 301..319 are padding
    logits = _logits(16, vocab, padded, seed=3).to(torch.float64)
    targets = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(4))
    logits[3, 200] = 30.0  # a rank-1 token in the second shard; others have theirs in the first
    results = workers2.run(_sharded_stats, logits, targets, vocab, 0.8)
    want = dense_reference(logits, targets, vocab, 0.8)
    for got in results:  # every rank holds the whole answer
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_ks_must_be_distinct_positive_integers():
    assert check_ks([8, 64]) == (8, 64)
    for bad in ([0], [8, 8], [2.5], [True]):
        with pytest.raises(ValueError, match="ks"):
            check_ks(bad)


def test_ratio_intervals_are_paired_over_prompts():
    rng = np.random.default_rng(0)
    prompts = 60
    counts = rng.integers(5, 40, size=prompts)
    difficulty = rng.normal(0.0, 1.0, size=prompts)  # shared by both arms: cancels in the paired difference
    a = (0.5 + 0.1 * difficulty) * counts
    b = (0.52 + 0.1 * difficulty) * counts
    spec = IntervalSpec(resamples=500)
    qa, qb = ms.ratio(a, counts), ms.ratio(b, counts)
    paired = ms.prompt_interval(ms.difference(qb, qa), prompts, spec, "d")
    alone = ms.prompt_interval(qb, prompts, spec, "b")
    assert paired.estimate == pytest.approx(0.02)
    assert paired.low > 0  # the paired difference is separated ...
    assert paired.high - paired.low < 0.2 * (alone.high - alone.low)  # ... because the difficulty cancels
    assert ms.prompt_interval(qb, prompts, spec, "b") == alone  # seeded: the same interval again


def test_student_t_quantiles_and_the_seed_interval():
    assert ms.student_t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-5)
    assert ms.student_t_quantile(0.975, 1) == pytest.approx(12.706205, abs=1e-4)
    assert ms.student_t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-5)
    assert ms.student_t_quantile(0.025, 2) == pytest.approx(-4.302653, abs=1e-5)
    iv = ms.seed_interval([1.0, 2.0, 3.0])
    assert iv.estimate == 2.0 and iv.high - 2.0 == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)
    assert math.isnan(ms.seed_interval([1.0]).low)


def test_verdicts_follow_the_fixed_rule():
    above, below, across = Interval(1.0, 0.5, 1.5), Interval(-1.0, -1.5, -0.5), Interval(0.1, -0.5, 0.7)
    assert ms.verdict(+1, above, above) == "holds"
    assert ms.verdict(-1, below, below) == "holds"
    assert ms.verdict(+1, below, below) == "fails"
    assert ms.verdict(+1, above, across) == "cannot tell"  # the seeds do not agree
    assert ms.verdict(+1, above, None) == "holds"  # one seed: the prompts' interval alone
    assert ms.verdict(+1, above, Interval(1.0, math.nan, math.nan)) == "cannot tell"
    assert ms.threshold_verdict(Interval(0.97, 0.96, 0.98), 0.95) == "holds"
    assert ms.threshold_verdict(Interval(0.4, 0.35, 0.45), 0.95) == "fails"
    assert ms.threshold_verdict(Interval(0.95, 0.93, 0.97), 0.95) == "cannot tell"
