"""`vocab_parallel_token_stats`: per-token log-prob, entropy and top-N from vocab-sharded logits, in one pass.

Forward: one streaming pass over this rank's shard (records.py), ONE all-gather of the small per-token records over
the TP group, the same merge on every rank. Backward: one pass over the shard, no communication, optionally in place
into the logits buffer. The statistics are those of softmax(logits / temperature) over the true vocabulary.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rlvr.ops import backends
from megatron_rlvr.ops.records import all_gather_records, check_layout, merge_records, record_width, write_header
from megatron_rlvr.ops.reference import accumulate_dtype

_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


class TokenStats(NamedTuple):
    """Per-token statistics; logp/entropy [...], topn_logp/topn_ids [..., N]; fp32 (fp64 for fp64 logits)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    topn_logp: torch.Tensor
    topn_ids: torch.Tensor


class _TokenStatsFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits,
        target_ids,
        top_n,
        group,
        vocab_start,
        vocab_size,
        inv_temperature,
        inplace_backward,
        chunk_tokens,
        impl,
    ):
        num_tokens, vocab_local = logits.shape
        n_valid = vocab_local if vocab_size is None else min(max(vocab_size - vocab_start, 0), vocab_local)
        records = torch.empty((num_tokens + 1, record_width(top_n)), dtype=torch.float64, device=logits.device)
        backends.shard_forward(
            impl,
            logits,
            target_ids,
            records[:num_tokens],
            top_n=top_n,
            vocab_start=vocab_start,
            n_valid=n_valid,
            inv_temperature=inv_temperature,
            chunk_tokens=chunk_tokens,
        )
        write_header(records, vocab_start, vocab_local, n_valid)
        gathered = all_gather_records(records, group)
        check_layout(gathered, target_ids, vocab_size, top_n)
        merged = merge_records(gathered, top_n, accumulate_dtype(logits.dtype))
        ctx.save_for_backward(logits, target_ids, merged.topn_ids, merged.logz, merged.entropy)
        ctx.mark_non_differentiable(merged.topn_ids)
        ctx.layout = (vocab_start, n_valid, inv_temperature, chunk_tokens, impl, inplace_backward)
        ctx.consumed = False
        return merged.logp, merged.entropy, merged.topn_logp, merged.topn_ids

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_topn, _grad_ids):
        vocab_start, n_valid, inv_temperature, chunk_tokens, impl, inplace_backward = ctx.layout
        if ctx.consumed:
            raise RuntimeError(
                "vocab_parallel_token_stats(inplace_backward=True): the logits buffer already holds a gradient; "
                "a second backward through the same graph needs inplace_backward=False"
            )
        logits, target_ids, topn_ids, logz, entropy = ctx.saved_tensors
        if inplace_backward:
            grad = logits
            # Tell autograd the buffer changed, so a node that saved these logits for its own backward fails loudly.
            torch.autograd.graph.increment_version(logits)
            ctx.consumed = True
        else:
            grad = torch.empty_like(logits)
        small = logz.dtype
        backends.shard_backward(
            impl,
            logits,
            grad,
            target_ids,
            topn_ids,
            logz,
            entropy,
            grad_logp.to(small).contiguous(),
            grad_entropy.to(small).contiguous(),
            grad_topn.to(small).contiguous(),
            vocab_start=vocab_start,
            n_valid=n_valid,
            inv_temperature=inv_temperature,
            chunk_tokens=chunk_tokens,
        )
        return grad, None, None, None, None, None, None, None, None, None


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def vocab_parallel_token_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    top_n: int,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    inplace_backward: bool = False,
    chunk_tokens: int | None = None,
    implementation: str | None = None,
) -> TokenStats:
    """Per-token statistics of softmax(logits / temperature) over the vocabulary sharded across ``group``.

    logits [..., V_local] (fp32 or bf16; fp64 for gradcheck) hold global ids [vocab_start, vocab_start + V_local);
    target_ids [...] are global ids; ids >= vocab_size (the true vocabulary; default: every id the shards hold) are
    padding and excluded everywhere. group is the TP process group (None: one process, no communication).
    Returns TokenStats(logp, entropy, topn_logp, topn_ids), sorted by probability with ties to the lower id,
    differentiable w.r.t. logits except the ids. inplace_backward=True writes the gradient into the logits buffer
    (the caller promises not to read the logits afterwards). chunk_tokens bounds the [chunk, V_local] temporaries
    of the torch reference; the kernels stream rows and need only O(T * N) scratch. implementation: auto (default),
    reference, cpp or cuda (see backends.py).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"logits: expected a tensor [..., V_local], got {type(logits).__name__}")
    if logits.dtype not in _LOGITS_DTYPES:
        raise ValueError(f"logits: expected dtype float32 or bfloat16 (float64 for gradcheck), got {logits.dtype}")
    if not isinstance(target_ids, torch.Tensor) or target_ids.dtype.is_floating_point or target_ids.is_complex():
        raise ValueError(f"target_ids: expected an integer tensor of shape {tuple(logits.shape[:-1])}")
    if tuple(target_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target_ids: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
            f"got {tuple(target_ids.shape)}"
        )
    if target_ids.device != logits.device:
        raise ValueError(f"target_ids: expected device {logits.device}, got {target_ids.device}")
    top_n = _check_int("top_n", top_n, 0)
    vocab_start = _check_int("vocab_start", vocab_start, 0)
    if vocab_size is not None:
        vocab_size = _check_int("vocab_size", vocab_size, 1)
    if chunk_tokens is not None:
        chunk_tokens = _check_int("chunk_tokens", chunk_tokens, 1)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    impl = backends.resolve(logits.device, implementation, top_n)

    lead_shape = tuple(logits.shape[:-1])
    vocab_local = logits.shape[-1]
    if not logits.is_contiguous():
        backends.warn_once(
            f"vocab_parallel_token_stats: logits {tuple(logits.shape)} with strides {logits.stride()} are not "
            f"contiguous, so they are copied ({logits.numel() * logits.element_size() / 2**20:.0f} MiB) and an in-place "
            "backward only reuses the copy; pass contiguous logits (e.g. whole sequences and mask the last target)",
            stacklevel=3,
            key="non-contiguous logits",
        )
    flat_logits = logits.reshape(-1, vocab_local).contiguous()
    flat_targets = target_ids.reshape(-1).to(torch.int64).contiguous()
    logp, entropy, topn_logp, topn_ids = _TokenStatsFunction.apply(
        flat_logits,
        flat_targets,
        top_n,
        group,
        vocab_start,
        vocab_size,
        1.0 / float(temperature),
        bool(inplace_backward),
        chunk_tokens,
        impl,
    )
    return TokenStats(
        logp.view(lead_shape),
        entropy.view(lead_shape),
        topn_logp.view(lead_shape + (top_n,)),
        topn_ids.view(lead_shape + (top_n,)),
    )
