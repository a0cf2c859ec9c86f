"""CRPO's group-coupled contrastive term (``algo.distill.kind: crpo``; docs/distillation.md, "CRPO").

The teacher is the frozen initial policy reading a correct response of the same group before the sequence
(actor/teacher.py); it scored every response position and gave its top-K ids ``S_t`` and its scaled logits there.
On that support, with ``q = softmax_{S_t}(z_T)`` and ``p = softmax_{S_t}(z_pi)`` (both renormalised over S_t):

- ``E(x) = sum_j x_j log x_j`` (the negative entropy on the support), ``dE_t = E(p) - E(q)``;
- ``sim_t = -KL(p || q) = -sum_j p_j (log p_j - log q_j)``, q detached;
- per group g (its response positions pooled over its G responses, n_g of them), the positive set ``P_g``: the
  ``k_g = ceil(p n_g)`` positions of lowest dE (ties: the earlier row, then the earlier position);
- ``L_g = -log( sum_{t in P_g} exp(sim_t / tau) / sum_{t in g} exp(sim_t / tau) )``;
- ``L_CRPO = (1 / N_groups) sum_g L_g`` over the mini-batch's groups; a group without a correct response has no
  privileged context and ``L_g = 0`` (it trains as GRPO), but counts in ``N_groups``.

The normaliser couples a group's positions across micro-batches and data-parallel ranks, so the term is computed in
two passes (actor/megatron_actor.py): ``support_terms`` per position without grad over the whole mini-batch, then
``group_weights`` gives each position its detached coefficient ``c_t = dL_CRPO / dsim_t = (w_t - w^P_t) / (tau
N_groups)`` (``w = softmax_g(sim / tau)``, ``w^P = softmax_{P_g}(sim / tau)``, 0 off P_g) and its share of the
value ``L_g / (N_groups n_g)``; each micro-batch's loss then adds ``sum_t share_t + sum_t c_t sim_t`` where only the
gradient of the second sum is kept (``crpo_loss``). Summed over micro-batches and ranks this is L_CRPO's value and
exactly its gradient, as the weights were taken at the weights the update differentiates.

Choices the formula leaves open: ``sim``'s gradient is written in the detached-weight form ``sum_j g_j z_pi_j`` with
``g_j = -p_j ((log p_j - log q_j) - KL(p || q))``, which is exactly d sim / d z_pi; ``p n_g`` is rounded to 9
decimals before the ceiling (0.3 x 10 positions is 3, not 4).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


def support_terms(student_at: Tensor, teacher_logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sim [B, T], dE [B, T]) on the teacher's top-K support, detached, 0 off the mask."""
    log_p = torch.log_softmax(student_at.detach(), dim=-1)
    log_q = torch.log_softmax(teacher_logits.detach().to(log_p.dtype), dim=-1)
    p, q = log_p.exp(), log_q.exp()
    sim = -(p * (log_p - log_q)).sum(dim=-1)
    d_entropy = (p * log_p).sum(dim=-1) - (q * log_q).sum(dim=-1)
    zero = torch.zeros_like(sim)
    return torch.where(mask, sim, zero), torch.where(mask, d_entropy, zero)


def positive_count(share: float, positions: int) -> int:
    """k = ceil(share * positions) (the product rounded to 9 decimals first), at least 1 for a non-empty group."""
    return min(positions, max(1, math.ceil(round(share * positions, 9)))) if positions else 0


def group_weights(
    sim: Tensor, d_entropy: Tensor, mask: Tensor, group: Tensor, context: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, dict[str, float]]:
    """The whole mini-batch's per-position (coefficient, value share) [B, T, 2] of L_CRPO (module docstring), and
    its metrics. ``group`` [B] is each row's group index, ``context`` [B] whether its group has a correct response."""
    b, t = sim.shape
    if tuple(group.shape) != (b,) or tuple(context.shape) != (b,):
        raise ValueError(f"group / context: expected shape [B] = [{b}], got {tuple(group.shape)} / {context.shape}")
    dtype = torch.float64
    out = torch.zeros(b, t, 2, dtype=dtype)
    mask = mask.to(torch.bool).cpu()
    sim, d_entropy = sim.detach().cpu().to(dtype), d_entropy.detach().cpu().to(dtype)
    group, context = group.cpu(), context.cpu().to(torch.bool)
    ids = torch.unique(group)  # sorted: every rank sees the same order
    tau = cfg.distill.crpo.tau
    losses, positive_sims, all_sims = [], [], []
    for g in ids.tolist():
        rows = torch.nonzero(group == g).flatten()
        if not bool(context[rows].all()) or not bool(mask[rows].any()):
            continue  # no correct response in the group: no privileged context, L_g = 0
        where = mask[rows]  # [r, T]
        s, de = sim[rows][where], d_entropy[rows][where]  # row-major: earlier row, then earlier position
        n = s.numel()
        k = positive_count(cfg.distill.crpo.positive_share, n)
        order = torch.sort(de, stable=True).indices
        positive = torch.zeros(n, dtype=torch.bool)
        positive[order[:k]] = True
        scaled = s / tau
        log_all = torch.logsumexp(scaled, dim=0)
        log_pos = torch.logsumexp(scaled[positive], dim=0)
        w_all = torch.exp(scaled - log_all)
        w_pos = torch.where(positive, torch.exp(scaled - log_pos), torch.zeros_like(scaled))
        loss = log_all - log_pos
        coef = (w_all - w_pos) / tau / len(ids)
        share = torch.full_like(s, float(loss) / (len(ids) * n))
        block = torch.zeros(len(rows), t, 2, dtype=dtype)
        block[where] = torch.stack([coef, share], dim=-1)
        out[rows] = block
        losses.append(float(loss))
        positive_sims.append(s[positive].mean())
        all_sims.append(s.mean())
    kept = len(losses)
    metrics = {
        "crpo/loss": sum(losses) / max(len(ids), 1),
        "crpo/no_context_share": (len(ids) - kept) / max(len(ids), 1),
        "crpo/sim": float(torch.stack(all_sims).mean()) if kept else 0.0,
        "crpo/positive_sim": float(torch.stack(positive_sims).mean()) if kept else 0.0,
    }
    return out, metrics


def sim_form(student_at: Tensor, teacher_logits: Tensor) -> Tensor:
    """[B, T] whose gradient w.r.t. ``student_at`` is d sim / d z_pi (its value is meaningless)."""
    log_p = torch.log_softmax(student_at.detach(), dim=-1)
    log_q = torch.log_softmax(teacher_logits.detach().to(log_p.dtype), dim=-1)
    p = log_p.exp()
    d = log_p - log_q
    kl = (p * d).sum(dim=-1, keepdim=True)
    return (-p * (d - kl) * student_at).sum(dim=-1)


def crpo_loss(student_at: Tensor, teacher_logits: Tensor, weights: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(this micro-batch's term of L_CRPO with L_CRPO's gradient, its value) from ``group_weights``' [B, T, 2]."""
    w = weights.detach().to(device=student_at.device, dtype=student_at.dtype)
    coef, share = w[..., 0], w[..., 1]
    zero = torch.zeros_like(coef)
    form = torch.where(mask, coef * sim_form(student_at, teacher_logits), zero).sum()
    value = torch.where(mask, share, zero).sum()
    return value + (form - form.detach()), value
