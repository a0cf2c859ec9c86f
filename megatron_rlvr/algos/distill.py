"""On-policy distillation terms on per-token statistics (docs/distillation.md), beside the KL term.

A frozen teacher T scored the student's own sampled responses in one pass of the fused op (teacher.py): per response
token its log-prob of the sampled token ``teacher.logp`` [B, T], its top-N ids ``teacher.topn_ids`` [B, T, N] and
its temperature-scaled logits at those ids ``teacher.topn_logits`` [B, T, N]. The student brings its log-prob of the
sampled token (the op's) and its own scaled logits at the teacher's ids (``ops.given_ids``). Two signals:

- ``reverse_kl_sampled``: the per-token advantage ``a_t = -(logp_pi[t] - logp_T[t])``, detached, times
  ``distill_coef``, added to the loss's per-token advantage (or alone, with ``distill_only``). It goes through the
  policy-gradient path of every loss with the PPO weight ``w = A_t * rho * keep``, clip and rollout correction alike.
- ``topn_forward_kl``: with ``S_t`` the teacher's top-N ids, ``q = softmax_{S_t}(z_T)`` and ``p~ = softmax_{S_t}(z_pi)``
  (both renormalised over ``S_t``; the log-partition cancels, so the scaled logits at the ids suffice), the term
  ``sum_j q_j (log q_j - log p~_j)``, aggregated with ``loss_agg`` like the KL term, times ``distill_coef``.

Choices the formulas leave open:
- The forward-KL term's value is the KL itself; its gradient is written as the detached-weight form
  ``sum_j (p~_j - q_j) z_pi_j`` (the exact gradient of KL(q || p~) w.r.t. the student's logits, as sum q = 1). So a
  teacher equal to the student (identical inputs, hence bit-identical q and p~) gives a value and a gradient of
  exactly 0, which autograd through log_softmax would miss by a rounding of ``sum q``.
- q and p~ are computed from the same function of the same kind of input (scaled logits at the ids), never mixing
  the op's log-probs with gathered logits: that is what makes the equality exact.
- ``distill_coef = 0`` adds nothing at all (policy_loss skips both terms; the metrics are still reported), so the
  loss is the RL loss bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's scores of the student's response tokens, in the student's [B, T] layout (0 off the mask)."""

    logp: Tensor  # [B, T] log pi_T(y_t)
    topn_ids: Tensor  # [B, T, N] int64: the teacher's top-N ids, rank 1 first
    topn_logits: Tensor  # [B, T, N] the teacher's logits / temperature at those ids


def check_teacher(teacher: TeacherScores, shape: tuple[int, int], student_at: Tensor | None, cfg: AlgoConfig) -> None:
    """Shapes of the teacher's scores and of the student's logits at the teacher's ids; errors name the argument."""
    if tuple(teacher.logp.shape) != shape:
        raise ValueError(f"teacher.logp: expected shape {shape} like stats.logp, got {tuple(teacher.logp.shape)}")
    for name, tensor in (("teacher.topn_ids", teacher.topn_ids), ("teacher.topn_logits", teacher.topn_logits)):
        if tensor.dim() != 3 or tuple(tensor.shape[:2]) != shape:
            raise ValueError(
                f"{name}: expected shape [B, T, N] = [{shape[0]}, {shape[1]}, N], got {tuple(tensor.shape)}"
            )
    uses_topn = cfg.distill.signal in ("topn_forward_kl", "both")
    if uses_topn and student_at is None:
        raise ValueError(
            "student_at_teacher_ids: algo.distill.signal="
            f"{cfg.distill.signal} needs the student's scaled logits at the teacher's top-N ids [B, T, N]"
        )
    if student_at is not None and tuple(student_at.shape) != tuple(teacher.topn_ids.shape):
        raise ValueError(
            f"student_at_teacher_ids: expected shape {tuple(teacher.topn_ids.shape)} like "
            f"teacher.topn_ids, got {tuple(student_at.shape)}"
        )


def reverse_kl_advantage(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """``a_t = -(logp_pi - logp_T)`` on response tokens, 0 elsewhere (detached)."""
    a = teacher_logp.detach().to(logp.dtype) - logp.detach()
    return torch.where(mask, a, torch.zeros_like(a))


def topn_forward_kl(student_at: Tensor, teacher_topn_logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(value [B, T], gradient form [B, T]) of KL(q || p~) over the teacher's top-N ids; both 0 off the mask.
    The form's gradient w.r.t. ``student_at`` is ``p~ - q``; its value is meaningless (add ``form - form.detach()``)."""
    z_t = teacher_topn_logits.detach().to(student_at.dtype)
    log_q = torch.log_softmax(z_t, dim=-1)
    log_p = torch.log_softmax(student_at.detach(), dim=-1)
    q, p = log_q.exp(), log_p.exp()
    value = (q * (log_q - log_p)).sum(dim=-1)
    form = ((p - q) * student_at).sum(dim=-1)
    zero = torch.zeros_like(value)
    return torch.where(mask, value, zero).detach(), torch.where(mask, form, zero)


@torch.no_grad()
def distill_metrics(
    logp: Tensor, student_top1: Tensor, teacher: TeacherScores, forward_kl: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Means over response tokens: distill/reverse_kl (the sampled estimate logp_pi - logp_T of KL(pi || T)),
    distill/forward_kl_topn, distill/teacher_logp, distill/top1_agreement (student's rank-1 id = teacher's)."""
    count = mask.sum().clamp(min=1).to(logp.dtype)

    def mean(values: Tensor) -> Tensor:
        return torch.where(mask, values.to(logp.dtype), torch.zeros_like(logp)).sum() / count

    teacher_logp = teacher.logp.to(logp.dtype)
    return {
        "distill/reverse_kl": mean(logp.detach() - teacher_logp),
        "distill/forward_kl_topn": mean(forward_kl),
        "distill/teacher_logp": mean(teacher_logp),
        "distill/top1_agreement": mean(student_top1 == teacher.topn_ids[..., 0].to(student_top1.device)),
    }
