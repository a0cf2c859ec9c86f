"""Policy losses (GRPO, CaSP and the paper's baselines) on per-token statistics only, through one code path.

Every loss is PPO-clip's detached-weight form ``-w[t] * target[t]`` with ``w = A_t * rho * keep`` (docs/algorithms.md),
and a loss name only chooses how its tokens are shaped (see ``_Shaping``):
- the per-token advantage ``A_t`` (entropy_adv adds an entropy term),
- a detached multiplier of ``w`` (CaSP's rank-1 penalty, w_reinforce, psr/nsr, forking_tokens, clip_cov),
- CaSP's label-smoothed target on positive samples, and
- extra per-token terms (kl_cov's penalty, the entropy bonus, the optional k3 KL to a reference).
So ``grpo`` is ``casp`` with alpha = lambda_top1 = 0, by construction.
Three options act on every loss alike: the KL coefficient may be given per sequence (PBA anchors only risky prompts'
responses, pba.py), the rollout correction reweights ``w``, and ARMOR's mixed ratio (mixed_ratio.py) replaces the
ratio and the target's log-prob by their mixtures with the reference.

The returned loss's value is the clipped surrogate ``-scale * min(rho * A, clip(rho) * A)`` (plus the extra terms),
while its gradient is exactly that of the detached-weight form: ``value.detach() + (form - form.detach())``.
For every loss but CaSP's smoothed positives the two have the same gradient anyway (PPO-clip equivalence).

Choices where docs/algorithms.md leaves room (each checked by tests/unit/algos against a dense oracle):
- CaSP's candidate weights u are detached (a target distribution, not a path for gradient).
- CaSP's adaptive candidate set C_t (``candidates: adaptive``, token_masks.adaptive_candidates) is decided from the
  detached top-N probabilities: the smallest top-ranked prefix reaching ``candidate_mass`` (rank 1 always in, a
  prefix reaching the mass exactly stops there, at most top_n, ``candidate_mass = 1`` keeps all top_n); u is
  uniform 1/|C_t| or the softmax over C_t, 0 outside it. A full C_t gets the fixed path's u bit for bit, so
  ``candidate_mass = 1`` is ``fixed`` exactly.
- A per-sequence KL coefficient (``kl_coef`` [B]) replaces ``algo.kl.coef`` for the k3 term, row by row; 0 on a
  row removes its KL term exactly (``torch.where``, so an infinite estimate on it cannot leak in as NaN).
- The entropy bonus, k3 KL and kl_cov penalty are aggregated with the same ``loss_agg`` as the policy term.
- kl_cov / clip_cov keep PPO-clip underneath and select the top ``cov_fraction`` tokens deterministically within
  the tokens of this call (verl's clip_cov samples among a covariance band instead).
- forking_tokens and psr / nsr zero the other tokens' weights but keep every response token in the normalizer.
- On-policy distillation (distill.py): the reverse-KL signal is added to the per-token advantage after the loss's
  shaping (so CaSP's positive / negative split stays the sample's), and the top-N forward KL is one more extra term.
- The rollout correction (rollout_correction.py) multiplies the detached multiplier of ``w``, so it scales the policy
  term's value and gradient alike, for every loss; the extra terms (entropy bonus, KL, kl_cov penalty) are not
  reweighted, and corrected-away tokens stay in the normalizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_rlvr.algos.aggregate import aggregate, response_counts
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.crpo import crpo_loss
from megatron_rlvr.algos.distill import (
    TeacherScores,
    check_teacher,
    distill_metrics,
    reverse_kl_advantage,
    topn_forward_kl,
)
from megatron_rlvr.algos.metrics import loss_metrics
from megatron_rlvr.algos.mixed_ratio import mixed_log_probs
from megatron_rlvr.algos.rollout_correction import correction_weights
from megatron_rlvr.algos.token_masks import adaptive_candidates, high_entropy_mask, top_covariance_mask
from megatron_rlvr.algos.token_view import TokenView

if TYPE_CHECKING:
    from megatron_rlvr.ops import TokenStats


@dataclass
class _Shaping:
    advantages: Tensor  # the per-token advantages entering w and the clip condition
    weight_scale: Tensor | None = None  # detached multiplier of w (None = 1)
    smoothing: Tensor | None = None  # CaSP: the share alpha moved onto the top-N candidates, 0 elsewhere
    candidates: Tensor | None = None  # CaSP adaptive: bool [B, T, top_n], the set C_t (None = every top-N column)
    penalty: Tensor | None = None  # extra per-token loss (kl_cov)
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * agg(entropy)


def _choose(condition: Tensor, if_true: float, if_false: float, like: Tensor) -> Tensor:
    """Per-token constant in ``like``'s dtype (torch.where on Python floats would round them to float32)."""
    return torch.where(condition, torch.full_like(like, if_true), torch.full_like(like, if_false))


def _grpo(v: TokenView) -> _Shaping:
    return _Shaping(v.advantages)


def _casp(v: TokenView) -> _Shaping:
    cfg = v.cfg
    shaping = _Shaping(v.advantages)
    if cfg.loss.apply_to in ("both", "positive"):
        smoothed = v.positive & v.high_entropy
        shaping.smoothing = _choose(smoothed, cfg.loss.alpha, 0.0, v.logp)
        if cfg.loss.candidates == "adaptive":
            shaping.candidates = adaptive_candidates(v.topn_logp, cfg.loss.candidate_mass)
    if cfg.loss.apply_to in ("both", "negative"):
        penalized = v.negative & v.high_entropy & v.is_top1
        shaping.weight_scale = _choose(penalized, 1.0 + cfg.loss.lambda_top1, 1.0, v.logp)
    return shaping


def _entropy_bonus(v: TokenView) -> _Shaping:
    return _Shaping(v.advantages, entropy_coef=v.cfg.loss.beta)


def _entropy_adv(v: TokenView) -> _Shaping:
    # Capped at |A| / kappa so the shaping never flips the sign of a non-zero advantage (kappa > 1).
    bonus = torch.minimum(v.cfg.loss.beta * v.entropy.detach(), v.advantages.abs() / v.cfg.loss.kappa)
    return _Shaping(v.advantages + bonus)


def _kl_cov(v: TokenView) -> _Shaping:
    selected = top_covariance_mask(v.logp, v.advantages, v.mask, v.cfg.loss.cov_fraction)
    penalty = torch.where(selected, v.cfg.loss.beta * (v.logp - v.old_logp).abs(), torch.zeros_like(v.logp))
    return _Shaping(v.advantages, penalty=penalty)


def _clip_cov(v: TokenView) -> _Shaping:
    selected = top_covariance_mask(v.logp, v.advantages, v.mask, v.cfg.loss.cov_fraction)
    return _Shaping(v.advantages, weight_scale=(~selected).to(v.logp.dtype))


def _w_reinforce(v: TokenView) -> _Shaping:
    return _Shaping(v.advantages, weight_scale=_choose(v.positive, v.cfg.loss.lambda_pos, 1.0, v.logp))


def _psr(v: TokenView) -> _Shaping:
    return _Shaping(v.advantages, weight_scale=v.positive.to(v.logp.dtype))


def _nsr(v: TokenView) -> _Shaping:
    return _Shaping(v.advantages, weight_scale=v.negative.to(v.logp.dtype))


def _forking_tokens(v: TokenView) -> _Shaping:
    # The normalizer stays every response token, so the step size per token matches GRPO's.
    return _Shaping(v.advantages, weight_scale=v.high_entropy.to(v.logp.dtype))


# The terms of the loss among policy_loss's metrics. Given the whole mini-batch's counts, each micro-batch reports its
# share of the mini-batch value: these add up over micro-batches and data-parallel ranks (the rest are averages).
# kl_ref is the k3 estimate itself; kl_loss, present with per-sequence coefficients, is the term the loss adds.
LOSSES: dict[str, Callable[[TokenView], _Shaping]] = {
    "grpo": _grpo,
    "casp": _casp,
    "entropy_bonus": _entropy_bonus,
    "entropy_adv": _entropy_adv,
    "kl_cov": _kl_cov,
    "clip_cov": _clip_cov,
    "w_reinforce": _w_reinforce,
    "psr": _psr,
    "nsr": _nsr,
    "forking_tokens": _forking_tokens,
}


def candidate_weights(topn_logp: Tensor, weights: str, inside: Tensor | None = None) -> Tensor:
    """CaSP's detached weights u over the top-N candidates: uniform 1/N, or softmax of their log-probs; with
    ``inside`` (bool like topn_logp, the adaptive set C_t) over C_t only, 0 outside it."""
    if inside is not None:
        if weights == "uniform":
            # 1/k rounded as the fixed path rounds 1/N (a Python float cast to the dtype): a full set is bit-equal
            table = torch.tensor(
                [0.0] + [1.0 / k for k in range(1, topn_logp.shape[-1] + 1)],
                dtype=topn_logp.dtype,
                device=topn_logp.device,
            )
            share = table[inside.sum(dim=-1)][..., None].expand_as(topn_logp)
            return torch.where(inside, share, torch.zeros_like(share))
        if weights == "softmax":
            return torch.softmax(topn_logp.detach().masked_fill(~inside, float("-inf")), dim=-1)
    elif weights == "uniform":
        return torch.full_like(topn_logp, 1.0 / topn_logp.shape[-1]).detach()
    elif weights == "softmax":
        return torch.softmax(topn_logp.detach(), dim=-1)
    raise ValueError(f"algo.loss.weights: got {weights!r}; allowed values: 'uniform', 'softmax'")


def policy_loss(
    stats: TokenStats,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    *,
    ref_logp: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    target_ids: Tensor | None = None,
    kl_coef: Tensor | None = None,
    teacher: TeacherScores | None = None,
    student_at_teacher_ids: Tensor | None = None,
    crpo_weights: Tensor | None = None,
    mixed_ratio_share: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss ``cfg.loss.kind`` of one (micro-)batch and its metrics (plain floats over this batch's response tokens).

    ``stats`` is the fused op's TokenStats with [B, T] / [B, T, N] tensors (N >= cfg.loss.top_n; the first
    cfg.loss.top_n columns enter the loss, up to three feed the rank metrics); ``old_logp`` [B, T], or None when the
    update is exactly on-policy (the behaviour log-probs are then ``stats.logp.detach()``); ``advantages`` [B];
    ``mask`` [B, T] marks response tokens (bool or 0/1). ``ref_logp`` [B, T] is required when cfg.kl.coef > 0.
    ``rollout_logp`` [B, T], the engine's log-probs of the sampled tokens, is required when cfg.rollout_correction.kind
    is not "none" (and unused otherwise); its metrics come back as ``rollout_correction/*``.
    ``num_tokens`` / ``num_seqs``: the whole mini-batch's response tokens / responses, so micro-batch losses sum to
    the mini-batch loss; default this batch's own counts. kl_cov / clip_cov select their tokens within this batch.
    ``target_ids`` [B, T], the sampled ids, make "y_t is rank 1" an id comparison (recommended); without them it is
    read from the statistics (logp equal to the rank-1 log-prob up to rounding).
    ``kl_coef`` [B], per response, replaces cfg.kl.coef in the k3 KL term (PBA); ``ref_logp`` is then required
    when any entry is > 0. Its term comes back as the metric ``kl_loss`` (``kl_ref`` stays the unweighted estimate).
    ``teacher`` (distill.TeacherScores, required when cfg.distill.kind is not "none") and ``student_at_teacher_ids``
    [B, T, N] (the student's logits / temperature at the teacher's top-N ids, ops.given_ids; required by the
    topn_forward_kl signal) add the distillation terms of distill.py; metrics ``distill/*`` and ``distill_loss``.
    Under ``algo.distill.kind: crpo`` those terms are off and ``crpo_weights`` [B, T, 2] (crpo.group_weights over the
    whole mini-batch) with ``student_at_teacher_ids`` add ``crpo_coef * L_CRPO``'s share (crpo.py); metric
    ``crpo_loss``. ``mixed_ratio_share``: ARMOR's a (`AlgoConfig.mixed_ratio_share` of the run's groups), required
    exactly when ``cfg`` asks for the mixed ratio (``algo.armor``).
    """
    if cfg.loss.kind not in LOSSES:
        raise ValueError(f"algo.loss.kind: got {cfg.loss.kind!r}; allowed values: {', '.join(LOSSES)}")
    if cfg.distill.kind != "none" and teacher is None:
        raise ValueError(
            f"teacher: algo.distill.kind={cfg.distill.kind} needs the teacher's scores of the response tokens"
        )
    if cfg.distill.only:  # pure distillation: the group advantage term is off, whatever the rewards were
        advantages = torch.zeros_like(advantages)
    view = _token_view(stats, old_logp, advantages, mask, cfg, target_ids)
    if kl_coef is None:
        if cfg.kl.coef > 0 and ref_logp is None:
            raise ValueError(f"ref_logp: algo.kl.coef = {cfg.kl.coef} > 0 needs the reference model's log-probs [B, T]")
    else:
        kl_coef = _sequence_kl_coef(kl_coef, view.logp, ref_logp is not None)
    for name, given in (("ref_logp", ref_logp), ("rollout_logp", rollout_logp)):
        if given is not None and given.shape != view.logp.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(view.logp.shape)} like stats.logp, got {tuple(given.shape)}"
            )
    correct = cfg.rollout_correction.kind != "none"
    if correct and rollout_logp is None:
        raise ValueError(
            f"rollout_logp: algo.rollout_correction.kind = {cfg.rollout_correction.kind!r} needs the engine's "
            "log-probs of the sampled tokens [B, T]"
        )
    local_tokens, local_seqs = response_counts(view.mask)
    counts = dict(
        num_tokens=local_tokens if num_tokens is None else float(num_tokens),
        num_seqs=local_seqs if num_seqs is None else float(num_seqs),
        max_len_norm=cfg.loss.max_len_norm,
    )

    def agg(values: Tensor) -> Tensor:
        return aggregate(values, view.mask, cfg.loss.agg, **counts)

    shaping = LOSSES[cfg.loss.kind](view)
    adv = shaping.advantages.detach()
    # coefficient 0: the RL loss bit for bit; CRPO's teacher feeds its own term below, not these signals
    distilling = teacher is not None and cfg.distill.coef > 0 and cfg.distill.kind != "crpo"
    if teacher is not None:
        check_teacher(teacher, tuple(view.logp.shape), student_at_teacher_ids, cfg)
        if distilling and cfg.distill.signal in ("reverse_kl_sampled", "both"):
            adv = adv + cfg.distill.coef * reverse_kl_advantage(view.logp, teacher.logp, view.mask)
    # ARMOR (mixed_ratio.py): the mixed log-probs of policy and behaviour replace logp and old_logp in the ratio and
    # the target, so every loss's weight, clip and value read the mixed ratio; the plain pair otherwise
    policy_logp, behaviour_logp = view.logp, view.old_logp
    if cfg.mixes_ratio != (mixed_ratio_share is not None):
        raise ValueError(
            f"mixed_ratio_share: expected {'a share' if cfg.mixes_ratio else 'None'} (AlgoConfig.mixed_ratio_share) "
            f"with algo.armor = {cfg.armor}, got {mixed_ratio_share!r}"
        )
    if mixed_ratio_share is not None:
        if ref_logp is None:
            raise ValueError(
                f"ref_logp: ARMOR's mixed ratio (a = {mixed_ratio_share}) needs the reference model's log-probs [B, T]"
            )
        policy_logp, behaviour_logp = mixed_log_probs(view.logp, view.old_logp, ref_logp, mixed_ratio_share)
    log_ratio = policy_logp - behaviour_logp
    rho = torch.exp(log_ratio)
    clipped = ((adv > 0) & (rho > 1 + cfg.loss.eps_high)) | ((adv < 0) & (rho < 1 - cfg.loss.eps_low))
    scale = torch.ones_like(rho) if shaping.weight_scale is None else shaping.weight_scale.detach()
    if correct:
        correction, correction_metrics = correction_weights(view.old_logp, rollout_logp, view.mask, cfg)
        scale = scale * correction  # exact: a correction of 1 leaves every weight bit-equal
    # where, not products with 0/1 masks: an overflowing ratio (rho = inf) must give 0, not inf * 0 = NaN.
    contributes = (adv != 0) & (scale != 0)
    zero = torch.zeros_like(rho)
    weight = torch.where(contributes & ~clipped, adv * rho * scale, zero).detach()

    target = policy_logp
    if shaping.smoothing is not None:
        s = shaping.smoothing.detach()
        if shaping.candidates is None:
            u = candidate_weights(view.topn_logp, cfg.loss.weights)
            spread = (u * view.topn_logp).sum(dim=-1)
        else:  # where, not u = 0: a column outside C_t sends exactly no gradient (and no NaN from 0 * -inf)
            u = candidate_weights(view.topn_logp, cfg.loss.weights, shaping.candidates)
            terms = u * view.topn_logp
            spread = torch.where(shaping.candidates, terms, torch.zeros_like(terms)).sum(dim=-1)
        smoothed = (1 - s) * policy_logp + s * spread
        target = torch.where(s > 0, smoothed, policy_logp)
    pg_form = agg(-weight * target)
    with torch.no_grad():
        clipped_rho = rho.clamp(1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high)
        pg_value = agg(torch.where(contributes, -scale * torch.minimum(rho * adv, clipped_rho * adv), zero))
    loss = pg_value + (pg_form - pg_form.detach())

    extras: dict[str, Tensor] = {}
    if shaping.penalty is not None:
        extras["cov_penalty"] = agg(shaping.penalty)
        loss = loss + extras["cov_penalty"]
    if shaping.entropy_coef:
        extras["entropy_bonus"] = shaping.entropy_coef * agg(view.entropy)
        loss = loss - extras["entropy_bonus"]
    if ref_logp is not None:
        delta = ref_logp.detach().to(view.logp.dtype) - view.logp
        k3 = torch.exp(delta) - delta - 1
        extras["kl_ref"] = agg(k3)
        if kl_coef is not None:
            coef = kl_coef[:, None].expand_as(k3)
            extras["kl_loss"] = agg(torch.where(coef > 0, coef * k3, torch.zeros_like(k3)))
            loss = loss + extras["kl_loss"]
        elif cfg.kl.coef > 0:
            loss = loss + cfg.kl.coef * extras["kl_ref"]

    distilled: dict[str, Tensor] = {}
    if teacher is not None:
        forward_kl = torch.zeros_like(view.logp)
        if student_at_teacher_ids is not None:
            forward_kl, form = topn_forward_kl(student_at_teacher_ids, teacher.topn_logits, view.mask)
            if distilling and cfg.distill.signal in ("topn_forward_kl", "both"):
                term = cfg.distill.coef * agg(form)
                extras["distill_loss"] = cfg.distill.coef * agg(forward_kl)
                loss = loss + extras["distill_loss"] + (term - term.detach())
        distilled = distill_metrics(view.logp, stats.topn_ids[..., 0], teacher, forward_kl, view.mask)
    if teacher is not None and cfg.distill.kind == "crpo" and cfg.distill.crpo.coef > 0:  # 0: the RL loss bit for bit
        if crpo_weights is None or student_at_teacher_ids is None:
            raise ValueError(
                "crpo_weights: algo.distill.kind=crpo needs crpo.group_weights of the mini-batch [B, T, 2]"
            )
        term, value = crpo_loss(student_at_teacher_ids, teacher.topn_logits, crpo_weights, view.mask)
        extras["crpo_loss"] = cfg.distill.crpo.coef * value
        loss = loss + cfg.distill.crpo.coef * term

    metrics = loss_metrics(
        view, log_ratio=log_ratio, clipped=clipped, top_ranks=stats.topn_logp, candidates=shaping.candidates
    )
    if distilled:
        metrics.update(zip(distilled, torch.stack(list(distilled.values())).tolist()))
    metrics.update(loss=float(loss.detach()), pg_loss=float(pg_value), num_tokens=local_tokens)
    metrics.update({name: float(value.detach()) for name, value in extras.items()})
    if correct:
        metrics.update(zip(correction_metrics, torch.stack(list(correction_metrics.values())).tolist()))
    return loss, metrics


def _sequence_kl_coef(kl_coef: Tensor, logp: Tensor, have_ref: bool) -> Tensor:
    """Check the per-sequence KL coefficients [B] (finite, >= 0; ref_logp given where any is > 0), in logp's dtype."""
    if tuple(kl_coef.shape) != tuple(logp.shape[:1]):
        raise ValueError(
            f"kl_coef: expected shape [B] = [{logp.shape[0]}] (one per response), got {tuple(kl_coef.shape)}"
        )
    coef = kl_coef.detach().to(device=logp.device, dtype=logp.dtype)
    valid, anchored = torch.stack([(torch.isfinite(coef) & (coef >= 0)).all(), (coef > 0).any()]).tolist()
    if not valid:
        raise ValueError(f"kl_coef: expected finite values >= 0 per response, got {coef.tolist()}")
    if anchored and not have_ref:
        raise ValueError("ref_logp: a per-sequence kl_coef > 0 needs the reference model's log-probs [B, T]")
    return coef


def _token_view(
    stats: TokenStats,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    target_ids: Tensor | None,
) -> TokenView:
    """Check shapes (errors name the argument) and broadcast everything to [B, T]."""
    logp = stats.logp
    if logp.dim() != 2:
        raise ValueError(f"stats.logp: expected [B, T], got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    if old_logp is None:  # exactly on-policy: the behaviour policy is the current one (rho = 1)
        old_logp = logp.detach()
    for name, tensor in (("stats.entropy", stats.entropy), ("old_logp", old_logp), ("mask", mask)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} like stats.logp, got {tuple(tensor.shape)}")
    for name, tensor in (("stats.topn_logp", stats.topn_logp), ("stats.topn_ids", stats.topn_ids)):
        if tensor.dim() != 3 or tuple(tensor.shape[:2]) != shape or tensor.shape[2] < cfg.loss.top_n:
            raise ValueError(
                f"{name}: expected shape [B, T, N] = [{shape[0]}, {shape[1]}, N >= algo.loss.top_n = "
                f"{cfg.loss.top_n}], "
                f"got {tuple(tensor.shape)}"
            )
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages: expected shape [B] = [{shape[0]}] (one per response), got {tuple(advantages.shape)}"
        )
    mask = mask.to(torch.bool)
    adv = advantages.detach().to(logp.dtype)[:, None].expand(shape)
    is_top1 = _sampled_is_top1(stats, target_ids)
    return TokenView(
        logp=logp,
        old_logp=old_logp.detach().to(logp.dtype),
        entropy=stats.entropy,
        topn_logp=stats.topn_logp[..., : cfg.loss.top_n],
        is_top1=is_top1,
        advantages=adv,
        mask=mask,
        high_entropy=high_entropy_mask(stats.entropy, mask, cfg.loss.tau_q),
        positive=mask & (adv > 0),
        negative=mask & (adv < 0),
        cfg=cfg,
    )


def _sampled_is_top1(stats: TokenStats, target_ids: Tensor | None) -> Tensor:
    """Whether y_t is the rank-1 candidate: by id when the caller passes the sampled ids, else by probability.

    TokenStats carries no sampled ids; without them y_t counts as rank 1 when its log-prob equals the rank-1
    log-prob up to float rounding (a token tied with rank 1 is as probable as rank 1, so it is penalized alike).
    """
    top1 = stats.topn_ids[..., 0]
    if target_ids is not None:
        if tuple(target_ids.shape) != tuple(top1.shape):
            raise ValueError(
                f"target_ids: expected shape {tuple(top1.shape)} like stats.logp, got {tuple(target_ids.shape)}"
            )
        return top1 == target_ids.to(top1.device)
    logp, best = stats.logp.detach(), stats.topn_logp[..., 0].detach()
    tolerance = 8 * torch.finfo(logp.dtype).eps * (1 + best.abs())
    return logp >= best - tolerance
