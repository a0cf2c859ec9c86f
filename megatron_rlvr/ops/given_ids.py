"""The temperature-scaled logits at given global ids [..., K] from vocab-sharded logits, beside the fused op.

``logits_at_ids(logits, ids, ...) -> (logits_alias, values)``: ``values[..., k] = logits[..., ids[..., k]] /
temperature``, gathered on the rank that owns each id and summed over the TP group (one all-reduce of [..., K]);
``logits_alias`` is the logits buffer itself, to be handed to ``vocab_parallel_token_stats`` in place of the logits.

Why the alias: the fused op's backward writes the logits gradient in place into the logits buffer. Routing the op's
input through this function makes its incoming gradient that very buffer, and the gradient of ``values`` is added
into it in place (an index_add of [..., K] entries), so no second [T, V/tp] gradient is ever allocated. Backward has
no communication: the loss is the same on every TP rank, so each rank adds its share to the ids it owns.

On-policy distillation reads this (the student's scores of the teacher's top-N ids); the log-probs of those ids
renormalised over them need no log-partition: ``log_softmax(values)`` over K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _LogitsAtIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, vocab_start, inv_temperature, group):
        vocab_local = logits.shape[-1]
        local = ids - vocab_start
        owned = (local >= 0) & (local < vocab_local)
        safe = torch.where(owned, local, torch.zeros_like(local))
        flat = logits.reshape(-1, vocab_local)
        rows = torch.arange(flat.shape[0], device=logits.device)[:, None].expand(-1, ids.shape[-1])
        picked = flat[rows, safe.reshape(flat.shape[0], -1)].reshape(ids.shape)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        values = torch.where(
            owned, picked.to(dtype) * inv_temperature, torch.zeros((), dtype=dtype, device=logits.device)
        )
        if group is not None:
            dist.all_reduce(values, group=group)
        ctx.save_for_backward(safe, owned)
        ctx.set_materialize_grads(False)  # an unused output sends None, not a tensor of zeros to add
        ctx.layout = (tuple(logits.shape), logits.dtype, inv_temperature)
        return logits.view_as(logits), values

    @staticmethod
    def backward(ctx, grad_logits, grad_values):
        safe, owned = ctx.saved_tensors
        shape, dtype, inv_temperature = ctx.layout
        if grad_logits is None:
            grad_logits = torch.zeros(shape, dtype=dtype, device=safe.device)
        if grad_values is not None:
            vocab_local = shape[-1]
            grad_logits = grad_logits.contiguous()  # the op's buffer is: then this adds into it in place
            flat = grad_logits.view(-1, vocab_local)
            add = torch.where(owned, grad_values * inv_temperature, torch.zeros_like(grad_values))
            rows = torch.arange(flat.shape[0], device=flat.device)[:, None].expand(-1, safe.shape[-1])
            flat.index_put_((rows.reshape(-1), safe.reshape(-1)), add.reshape(-1).to(flat.dtype), accumulate=True)
        return grad_logits, None, None, None, None


def logits_at_ids(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits alias, scaled logits at ``ids``): logits [..., V_local] hold global ids [vocab_start, vocab_start +
    V_local); ids [..., K] are global ids of the true vocabulary (every one owned by some rank of ``group``).
    The values are float32 (float64 for float64 logits) and differentiable w.r.t. the logits."""
    if tuple(ids.shape[:-1]) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"ids: expected shape {tuple(logits.shape[:-1])} + (K,) like the logits without the vocab "
            f"dim, got {tuple(ids.shape)}"
        )
    if ids.dtype.is_floating_point:
        raise ValueError(f"ids: expected an integer tensor, got {ids.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    return _LogitsAtIds.apply(logits, ids.to(logits.device).long(), vocab_start, 1.0 / temperature, group)
