"""Test inputs and checks shared by the single-process, multi-process and GPU tests of the token-statistics op.

`make_case` builds full-vocabulary logits (padding columns filled with large values, so that counting them would
show), `shard_of` cuts one TP rank's slice, and `compare_to_oracle` runs the fused op on a shard and the dense
oracle on the full logits and returns the worst differences (values, gradients) and whether the ids agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rlvr.ops import reference, vocab_parallel_token_stats


class Case(NamedTuple):
    logits: torch.Tensor  # [T, V_padded]
    targets: torch.Tensor  # [T]
    vocab_size: int


def make_case(
    num_tokens: int, vocab_padded: int, vocab_size: int, dtype: torch.dtype, seed: int, ties: bool = False
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # a handful of distinct values: every top-N slot has equal-valued rivals at other ids and ranks
        logits = torch.randint(0, 3, (num_tokens, vocab_padded), generator=gen).to(torch.float64)
    else:
        logits = torch.randn(num_tokens, vocab_padded, generator=gen, dtype=torch.float64) * 3
    logits[:, vocab_size:] = 50.0  # padding: would dominate every statistic if it were counted
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    return Case(logits.to(dtype), targets, vocab_size)


def shard_of(logits: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, int]:
    width = logits.shape[-1] // tp
    return logits[..., rank * width : (rank + 1) * width].contiguous(), rank * width


def upstream_grads(num_tokens: int, top_n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed + 1)
    return tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in [(num_tokens,), (num_tokens,), (num_tokens, top_n)]
    )


def loss_of(stats, weights) -> torch.Tensor:
    w_logp, w_h, w_top = weights
    return (stats[0] * w_logp).sum() + (stats[1] * w_h).sum() + (stats[2] * w_top).sum()


def compare_to_oracle(
    case: Case,
    top_n: int,
    *,
    rank: int = 0,
    tp: int = 1,
    group=None,
    temperature: float = 1.0,
    implementation: str | None = None,
    inplace_backward: bool = False,
    chunk_tokens: int | None = None,
    device: str = "cpu",
) -> dict:
    """Max abs differences of our op on this rank's shard vs the dense oracle on the full logits."""
    full = case.logits.to(device)
    targets = case.targets.to(device)
    shard, start = shard_of(full, rank, tp)
    shard = shard.clone().requires_grad_()
    ours_in = shard.clone() if inplace_backward else shard
    stats = vocab_parallel_token_stats(
        ours_in,
        targets,
        top_n,
        group=group,
        vocab_start=start,
        vocab_size=case.vocab_size,
        temperature=temperature,
        inplace_backward=inplace_backward,
        chunk_tokens=chunk_tokens,
        implementation=implementation,
    )
    acc = reference.accumulate_dtype(full.dtype)
    weights = tuple(w.to(device) for w in upstream_grads(full.shape[0], top_n, acc, seed=7))
    (grad,) = torch.autograd.grad(loss_of(stats, weights), shard)

    dense_in = full.detach().clone().requires_grad_()
    dense = reference.dense_token_stats(dense_in, targets, top_n, vocab_size=case.vocab_size, temperature=temperature)
    (dense_grad,) = torch.autograd.grad(loss_of(dense, weights), dense_in)
    dense_grad_shard, _ = shard_of(dense_grad, rank, tp)

    def worst(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())  # equal infinities (masked logits) agree
        return 0.0 if a.numel() == 0 else diff.max().item()

    padded_cols = torch.arange(start, start + shard.shape[-1], device=device) >= case.vocab_size
    real = full[..., : case.vocab_size].double() / temperature
    finite = real[torch.isfinite(real)]
    return {
        "vocab": case.vocab_size,
        "max_abs_logit": finite.abs().max().item() if finite.numel() else 0.0,
        "dtype": str(stats.logp.dtype),
        "logp": worst(stats.logp, dense.logp),
        "entropy": worst(stats.entropy, dense.entropy),
        "topn_logp": worst(stats.topn_logp, dense.topn_logp),
        "ids_equal": bool(torch.equal(stats.topn_ids.cpu(), dense.topn_ids.cpu())),
        "grad": worst(grad, dense_grad_shard.to(grad.dtype)),
        "grad_scale": dense_grad_shard.abs().max().item() if dense_grad_shard.numel() else 0.0,
        "padding_grad_zero": bool((grad[..., padded_cols] == 0).all()),
        "shapes": (tuple(stats.logp.shape), tuple(stats.topn_ids.shape)),
    }
