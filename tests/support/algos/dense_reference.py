"""Test oracle: every loss written directly from docs/algorithms.md on full-vocabulary float64 logits, token by token.

Deliberately naive and independent of megatron_rlvr.algos: full log_softmax, a Python loop over tokens, per-row
torch.quantile, explicit if/else per loss. Also a dense TokenStats builder (for tests that check the loss code on its
own, without the fused op) and the random problem generator the gradient tests share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlvr.algos.config import AlgoConfig


@dataclass
class DenseStats:
    """Same fields as the fused op's TokenStats, computed from full-vocab log_softmax."""

    logp: Tensor
    entropy: Tensor
    topn_logp: Tensor
    topn_ids: Tensor


# Coefficients large enough that every loss's special path changes the gradient visibly: the loss tests' base config.
LOSS_COEFFICIENTS = {
    "loss.alpha": 0.3,
    "loss.lambda_top1": 0.5,
    "loss.tau_q": 0.5,
    "loss.beta": 0.1,
    "loss.kappa": 2.0,
    "loss.cov_fraction": 0.2,
    "loss.lambda_pos": 0.1,
}


def dense_token_stats(logits: Tensor, targets: Tensor, top_n: int, temperature: float = 1.0) -> DenseStats:
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    logp = logprobs.gather(-1, targets[..., None])[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    # A stable descending sort keeps equal values in id order: ties go to the lower id, as the contract says.
    ids = torch.sort(logprobs.detach(), dim=-1, descending=True, stable=True).indices[..., :top_n]
    return DenseStats(logp, entropy, logprobs.gather(-1, ids), ids)


@dataclass
class Problem:
    logits: Tensor  # [B, T, V] float64
    targets: Tensor  # [B, T]
    old_logp: Tensor  # [B, T]
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] bool
    ref_logp: Tensor  # [B, T]


def random_problem(seed: int, vocab_multiple: int = 2) -> Problem:
    """Random shapes, right-padded responses (one row fully padded), advantages of both signs and zero, and old
    log-probs perturbed enough that some tokens fall outside the clip range on both sides."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(4, 8, (1,), generator=g))
    t = int(torch.randint(4, 10, (1,), generator=g))
    v = vocab_multiple * int(torch.randint(4, 9, (1,), generator=g))
    logits = 2.0 * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=g)
    # Make some sampled tokens rank 1, as they often are in practice.
    greedy = torch.rand(b, t, generator=g) < 0.4
    targets = torch.where(greedy, logits.argmax(-1), targets)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[-1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old_logp = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    advantages[0], advantages[1] = abs(advantages[0]) + 0.1, -abs(advantages[1]) - 0.1
    advantages[2] = 0.0
    return Problem(logits, targets, old_logp, advantages, mask, ref_logp)


def reference_loss(
    logits: Tensor,
    targets: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    ref_logp: Tensor | None = None,
    temperature: float = 1.0,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    rollout_logp: Tensor | None = None,
    kl_coefs: Tensor | None = None,
    token_advantages: Tensor | None = None,
) -> Tensor:
    """The loss of docs/algorithms.md: value = clipped surrogate (+ extra terms), gradient = detached-weight form.
    ``kl_coefs`` [B]: the KL coefficient of each response in place of cfg.kl.coef (PBA). ``token_advantages``
    [B, T]: added to each token's advantage in the weight, clip and value (distillation's reverse-KL signal); which
    tokens are positive / negative samples stays the response's advantage."""
    B, T, _ = logits.shape
    correction = reference_correction(old_logp, rollout_logp, mask, cfg) if rollout_logp is not None else None
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    logp = logprobs.gather(-1, targets[..., None])[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    order = torch.sort(logprobs.detach(), dim=-1, descending=True, stable=True).indices
    top_ids = order[..., : cfg.loss.top_n]
    top_logp = logprobs.gather(-1, top_ids)

    # h[t]: entropy above the tau_q quantile of its own response's token entropies.
    high = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        if mask[b].any():
            if cfg.loss.tau_q == 0:
                high[b] = mask[b]
            else:
                threshold = torch.quantile(entropy[b][mask[b]].detach(), cfg.loss.tau_q)
                high[b] = (entropy[b].detach() > threshold) & mask[b]

    # kl_cov / clip_cov: top cov_fraction of tokens by (logp - mean logp) * (A - mean A) over response tokens.
    selected = torch.zeros(B, T, dtype=torch.bool)
    if cfg.loss.kind in ("kl_cov", "clip_cov"):
        positions = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
        lp = torch.stack([logp[b, t].detach() for b, t in positions])
        ad = torch.stack([advantages[b].detach().to(lp.dtype) for b, t in positions])
        cov = (lp - lp.mean()) * (ad - ad.mean())
        k = max(1, int(len(positions) * cfg.loss.cov_fraction))
        for index in torch.argsort(cov, descending=True)[:k].tolist():
            selected[positions[index]] = True

    grad_terms = torch.zeros(B, T, dtype=logits.dtype)
    value_terms = torch.zeros(B, T, dtype=logits.dtype)
    extra_terms = torch.zeros(B, T, dtype=logits.dtype)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            A = float(advantages[b])
            if cfg.loss.kind == "entropy_adv":
                A = A + min(cfg.loss.beta * float(entropy[b, t].detach()), abs(A) / cfg.loss.kappa)
            A_token = A if token_advantages is None else A + float(token_advantages[b, t])
            rho = float(torch.exp(logp[b, t].detach() - old_logp[b, t]))
            clipped = (A_token > 0 and rho > 1 + cfg.loss.eps_high) or (A_token < 0 and rho < 1 - cfg.loss.eps_low)
            scale = 1.0
            target = logp[b, t]
            if cfg.loss.kind == "casp":
                if A > 0 and high[b, t] and cfg.loss.apply_to in ("both", "positive"):
                    size = candidate_set_size(top_logp[b, t], cfg)
                    candidates = top_logp[b, t, :size]
                    if cfg.loss.weights == "uniform":
                        u = torch.full((size,), 1.0 / size, dtype=logits.dtype)
                    else:
                        u = torch.softmax(candidates.detach(), dim=-1)
                    target = (1 - cfg.loss.alpha) * logp[b, t] + cfg.loss.alpha * (u * candidates).sum()
                if (
                    A < 0
                    and high[b, t]
                    and targets[b, t] == top_ids[b, t, 0]
                    and cfg.loss.apply_to in ("both", "negative")
                ):
                    scale = 1.0 + cfg.loss.lambda_top1
            elif cfg.loss.kind == "w_reinforce" and A > 0:
                scale = cfg.loss.lambda_pos
            elif (
                cfg.loss.kind == "psr"
                and not A > 0
                or cfg.loss.kind == "nsr"
                and not A < 0
                or cfg.loss.kind == "forking_tokens"
                and not high[b, t]
                or cfg.loss.kind == "clip_cov"
                and selected[b, t]
            ):
                scale = 0.0
            if correction is not None:
                scale = scale * correction[b][t]
            w = 0.0 if clipped else A_token * rho * scale
            grad_terms[b, t] = -w * target
            clipped_rho = min(max(rho, 1 - cfg.loss.eps_low), 1 + cfg.loss.eps_high)
            value_terms[b, t] = -scale * min(rho * A_token, clipped_rho * A_token)
            extra = torch.zeros((), dtype=logits.dtype)
            if cfg.loss.kind == "kl_cov" and selected[b, t]:
                extra = extra + cfg.loss.beta * (logp[b, t] - old_logp[b, t]).abs()
            if cfg.loss.kind == "entropy_bonus":
                extra = extra - cfg.loss.beta * entropy[b, t]
            coef = cfg.kl.coef if kl_coefs is None else float(kl_coefs[b])
            if ref_logp is not None and coef > 0:
                d = ref_logp[b, t] - logp[b, t]
                extra = extra + coef * (torch.exp(d) - d - 1)
            extra_terms[b, t] = extra

    def agg(x: Tensor) -> Tensor:
        tokens = float(mask.sum()) if num_tokens is None else num_tokens
        seqs = float(mask.any(-1).sum()) if num_seqs is None else num_seqs
        if cfg.loss.agg == "token_mean":
            return x.sum() / tokens
        if cfg.loss.agg == "seq_mean_token_mean":
            return sum(x[b].sum() / mask[b].sum() for b in range(B) if mask[b].any()) / seqs
        return x.sum() / cfg.loss.max_len_norm / seqs

    grad_form = agg(grad_terms)
    return agg(value_terms) + (grad_form - grad_form.detach()) + agg(extra_terms)


def sequence_coefs(rows: int) -> Tensor:
    """A per-sequence KL coefficient [rows] with anchored (0.3, 0.1) and unanchored (0) rows, as PBA makes them."""
    return torch.tensor([(0.3, 0.0, 0.1)[i % 3] for i in range(rows)], dtype=torch.float64)


def candidate_set_size(top_logp: Tensor, cfg: AlgoConfig) -> int:
    """|C_t|: all top_n columns (fixed, or candidate_mass = 1), else the fewest top ranks whose probabilities sum
    to at least candidate_mass, at most top_n, summed one by one in Python floats."""
    if cfg.loss.candidates == "fixed" or cfg.loss.candidate_mass >= 1:
        return cfg.loss.top_n
    total = 0.0
    for k in range(cfg.loss.top_n):
        total += math.exp(float(top_logp[k].detach()))
        if total >= cfg.loss.candidate_mass:
            return k + 1
    return cfg.loss.top_n


def reference_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: AlgoConfig) -> list[list[float]]:
    """The rollout correction c[b][t] of docs/algorithms.md with Python floats, response by response (1 off the mask)."""
    B, T = mask.shape
    out = [[1.0] * T for _ in range(B)]
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        logs = [float(old_logp[b, t]) - float(rollout_logp[b, t]) for t in tokens]
        if cfg.rollout_correction.level == "sequence" and tokens:
            total = math.fsum(logs)
            if cfg.rollout_correction.kind == "tis":
                shared = cfg.rollout_correction.cap if total > math.log(cfg.rollout_correction.cap) else math.exp(total)
            else:
                shared = _band(math.exp(total / len(tokens)), cfg)
            values = [shared] * len(tokens)
        elif cfg.rollout_correction.kind == "tis":
            values = [min(math.exp(x), cfg.rollout_correction.cap) for x in logs]
        else:
            values = [_band(math.exp(x), cfg) for x in logs]
        for t, value in zip(tokens, values):
            out[b][t] = value
    return out


def _band(ratio: float, cfg: AlgoConfig) -> float:
    inside = cfg.rollout_correction.low <= ratio <= cfg.rollout_correction.high
    if cfg.rollout_correction.kind == "mis":
        return 1.0 if inside else 0.0
    return ratio if inside else 0.0
