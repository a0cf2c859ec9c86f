"""The fused op over real gloo TP groups (TP = 1, 2, 4): every rank's values and gradient shard equal the dense
oracle on the gathered full-vocabulary logits, for fp32 and bf16, both implementations, ties, padding that leaves a
whole shard empty, temperature != 1, N = 0 and in-place backward."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.ops import backends
from tests.integration.ops.cases import compare_to_oracle, make_case
from tests.integration.ops.test_token_stats import check

pytestmark = pytest.mark.dist

IMPLS = ["reference"] + (["cpp"] if backends.extension() is not None else [])
_groups: dict[int, object] = {}


def _tp_group(tp: int):
    """This rank's TP group when the world is split into consecutive groups of `tp` ranks (created once)."""
    import torch.distributed as dist

    if tp not in _groups:
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
        _groups[tp] = groups[rank // tp]
    return _groups[tp]


def _run_case(
    tp: int, dtype: torch.dtype, impl: str, top_n: int, vocab_size: int, ties: bool, temperature: float, inplace: bool
) -> dict:
    import torch.distributed as dist

    group = _tp_group(tp)
    rank_in_tp = dist.get_rank(group)
    # every TP group sees the same case; the padded width is a multiple of tp as megatron pads it
    case = make_case(10, 100, vocab_size, dtype, seed=20 + tp, ties=ties)
    result = compare_to_oracle(
        case,
        top_n,
        rank=rank_in_tp,
        tp=tp,
        group=group,
        temperature=temperature,
        implementation=impl,
        inplace_backward=inplace,
    )
    result["rank"] = dist.get_rank()
    return result


CASES = [  # (top_n, vocab_size, ties, temperature, inplace)
    (3, 97, False, 1.0, False),
    (4, 97, True, 1.0, False),
    (3, 70, False, 0.7, True),  # at TP = 4 the last shard [75, 100) is all padding
    (0, 100, False, 1.3, False),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2])
def test_tp_on_two_ranks(workers2, tp, dtype, impl):
    for case in CASES:
        for result in workers2.run(_run_case, tp, dtype, impl, *case):
            check(result, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_on_four_ranks(workers4, tp, dtype, impl):
    for case in CASES:
        for result in workers4.run(_run_case, tp, dtype, impl, *case):
            check(result, dtype)


def _wrong_vocab_start() -> str:
    import torch.distributed as dist

    from megatron_rlvr.ops import vocab_parallel_token_stats

    try:
        vocab_parallel_token_stats(torch.zeros(2, 8), torch.tensor([0, 1]), 2, group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_every_rank_names_a_bad_vocab_start(workers2):
    for message in workers2.run(_wrong_vocab_start):
        assert message.startswith("vocab_start: the shards must tile"), message
