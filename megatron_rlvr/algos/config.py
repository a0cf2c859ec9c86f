"""Configuration of advantages, the policy loss and the methods around it (docs/algorithms.md has every knob's math).

``algo`` is sections: the loss (``algo.loss``, its kind and knobs), the advantage (``algo.advantage``), the KL term
and its reference with PBA (``algo.kl``), the rollout correction (``algo.rollout_correction``), distillation with
CRPO (``algo.distill``), ARMOR (``algo.armor``) and ground-truth injection (``algo.ground_truth``); a section that
is a choice among alternatives says which with its ``kind``. Each field declares its doc and limits
(megatron_rlvr/settings.py), which the loader checks; constraints between fields are the run config's rules table
(megatron_rlvr/config/rules.py), and a registered method's own rules its ``check``. Derived facts
(`AlgoConfig.needs_reference`, `AlgoConfig.mixed_ratio_share`) are read here, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron_rlvr.algos.mixed_ratio import on_policy_share
from megatron_rlvr.settings import setting

LossName = Literal[
    "grpo", "casp", "entropy_bonus", "entropy_adv", "kl_cov", "clip_cov", "w_reinforce", "psr", "nsr", "forking_tokens"
]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
RolloutCorrection = Literal["none", "tis", "mis", "icepop"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)
DistillMode = Literal["none", "teacher", "self", "crpo"]
DISTILL_MODES: tuple[str, ...] = get_args(DistillMode)
DistillSignal = Literal["reverse_kl_sampled", "topn_forward_kl", "both"]
DISTILL_SIGNALS: tuple[str, ...] = get_args(DistillSignal)
Advantage = Literal["group", "reward", "signed_reward"]
ADVANTAGES: tuple[str, ...] = get_args(Advantage)


def _answer_template(text: str) -> bool:
    """A template whose only field is ``{answer}``, which it holds."""
    try:
        text.format(answer="")
    except (KeyError, IndexError, ValueError):
        return False
    return "{answer}" in text


@dataclass
class LossConfig:
    """The policy loss: ``kind`` picks it; every loss is PPO-clip's surrogate shaped per token (losses.py)."""

    kind: LossName = setting(
        "casp",
        "Which loss: grpo (PPO-clip on group advantages), casp (CaSP: label smoothing onto the top-N candidates of "
        "positive samples, a rank-1 penalty on negative ones), or a baseline: entropy_bonus, entropy_adv, kl_cov, "
        "clip_cov, w_reinforce, psr (positive samples only), nsr (negative only), forking_tokens.",
    )
    agg: LossAgg = setting(
        "token_mean",
        "How per-token terms are aggregated: token_mean (over every response token of the mini-batch), "
        "seq_mean_token_mean (per response, then over responses), seq_mean_token_sum_norm (per-response sums over "
        "max_len_norm, Dr. GRPO).",
    )
    max_len_norm: int = setting(1024, "The constant of seq_mean_token_sum_norm.", ge=1)
    eps_low: float = setting(
        0.2, "PPO clip: the ratio's lower bound is 1 - eps_low (which must stay positive).", ge=0, lt=1
    )
    eps_high: float = setting(0.28, "PPO clip: the ratio's upper bound is 1 + eps_high (DAPO's clip-higher).", ge=0)
    top_n: int = setting(
        3, "N of the top-N candidates the fused op returns: CaSP's smoothing set and the rank metrics.", ge=1
    )
    tau_q: float = setting(
        0.8,
        "Per-response entropy quantile: the tokens above it are high-entropy (CaSP's and forking_tokens' tokens, "
        "the high-entropy metrics); 0 = every response token.",
        ge=0,
        lt=1,
    )
    alpha: float = setting(
        0.05, "CaSP: the label-smoothing share moved onto the top-N candidates on positive samples.", ge=0, le=1
    )
    lambda_top1: float = setting(
        0.5, "CaSP: the extra penalty on a wrong token that is rank 1, on negative samples (1 + lambda_top1).", ge=0
    )
    weights: Literal["uniform", "softmax"] = setting(
        "uniform", "CaSP: the candidates' weights u, uniform 1/N or the softmax of their log-probs."
    )
    apply_to: Literal["both", "positive", "negative"] = setting(
        "both", "CaSP: which samples it shapes: the positive (smoothing), the negative (rank-1 penalty) or both."
    )
    candidates: Literal["fixed", "adaptive"] = setting(
        "fixed",
        "CaSP: the fixed top-N, or the smallest top-ranked set reaching candidate_mass of the probability (at most "
        "top_n; docs/algorithms.md, 'Adaptive candidates').",
    )
    candidate_mass: float = setting(0.9, "CaSP adaptive: the probability the candidate set reaches.", gt=0, le=1)
    beta: float = setting(0.01, "entropy_bonus, entropy_adv and kl_cov: their coefficient.", ge=0)
    kappa: float = setting(2.0, "entropy_adv: the entropy term is capped at |A| / kappa.", gt=0)
    cov_fraction: float = setting(
        0.002, "kl_cov and clip_cov: the fraction of tokens they select (at least one).", ge=0, le=1
    )
    lambda_pos: float = setting(0.1, "w_reinforce: the weight of positive samples.", ge=0)


@dataclass
class AdvantageConfig:
    """How rewards become per-response advantages (advantages.py)."""

    kind: Advantage = setting(
        "group",
        "group: GRPO's group-normalised reward (Dr. GRPO without normalize_std); reward: A = r (REINFORCE without a "
        "baseline; with psr, rejection-sampling fine-tuning); signed_reward: A = 2r - 1.",
    )
    normalize_std: bool = setting(True, "group: divide by the group's standard deviation (false: Dr. GRPO's r - mean).")
    eps: float = setting(1e-6, "group: added to the standard deviation before dividing.", ge=0)


@dataclass
class PbaConfig:
    """PBA, per-problem base anchoring (docs/exploration.md): M frozen-base samples per training prompt, drawn once and
    stored in the run directory; prompts with fewer than min_correct correct ones get the KL to the base."""

    enabled: bool = setting(False, "Anchor the risky prompts' responses to the base with the KL term.")
    base_samples: int = setting(16, "M: base-model samples per training prompt.", ge=1)
    min_correct: int = setting(
        2, "A prompt is risky below this many correct base samples (at most base_samples).", ge=0
    )
    coef: float = setting(0.1, "The KL coefficient of a risky prompt's responses (the others get algo.kl.coef).", ge=0)


@dataclass
class KlConfig:
    """The k3 KL term to a frozen reference (the initial policy), and PBA's per-response coefficients."""

    coef: float = setting(0.0, "The KL term's coefficient for every response; 0 = no term (and no reference).", ge=0)
    pba: PbaConfig = setting(factory=PbaConfig, doc="PBA: per-response coefficients from the base's evidence.")


@dataclass
class RolloutCorrectionConfig:
    """Reweighting for the engine that sampled not being the policy that trains (docs/algorithms.md, "Rollout
    correction"): rho = exp(old_logp - engine_logp) multiplies each token's policy-gradient weight."""

    kind: RolloutCorrection = setting(
        "none",
        "none; tis (truncated importance sampling: min(rho, cap)); mis (rho inside [low, high], else 0); icepop "
        "(1 inside [low, high], else 0).",
    )
    level: Literal["token", "sequence"] = setting(
        "token", "rho per token, or per response (the geometric mean of its tokens')."
    )
    cap: float = setting(2.0, "tis: the truncation of the weight (a weight of 1 must stay untruncated).", ge=1)
    low: float = setting(0.5, "mis and icepop: the kept band's lower end (rho = 1 must stay inside).", ge=0, le=1)
    high: float = setting(2.0, "mis and icepop: the kept band's upper end (rho = 1 must stay inside).", ge=1)


@dataclass
class CrpoConfig:
    """CRPO (docs/distillation.md, algos/crpo.py; algo.distill.kind = crpo): the initial policy (frozen, or an EMA of
    the policy) reading a correct response of the same group scores the responses; a group-coupled contrastive term
    over the teacher's top-K support is added to the RL loss."""

    top_k: int = setting(100, "K of the teacher's top-K support (capped at the vocabulary).", ge=1)
    positive_share: float = setting(
        0.3, "p: the share of a group's positions with the lowest dE that form P (at least one).", gt=0, le=1
    )
    tau: float = setting(1.0, "The temperature of the contrast's softmax over sim.", gt=0, finite=True)
    coef: float = setting(
        5.0, "lambda: loss = RL loss + coef * L_CRPO; 0 = the RL loss bit for bit.", ge=0, finite=True
    )
    correct_reward: float = setting(
        1.0, "A response is correct (a privileged context) when its reward is at least this.", finite=True
    )
    teacher: Literal["frozen", "ema"] = setting(
        "frozen", "The initial policy, or an EMA of the policy (its weights are checkpointed)."
    )
    ema_decay: float = setting(
        0.1, "ema: after every optimizer step, teacher = decay * teacher + (1 - decay) * policy.", ge=0, le=1
    )


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md, algos/distill.py): a frozen teacher scores the student's sampled
    responses."""

    kind: DistillMode = setting(
        "none",
        "none; teacher (the model of teacher_hf_dir, the same tokenizer); self (the frozen initial policy reading "
        "template with the reference answer before the prompt); crpo (see algo.distill.crpo).",
    )
    coef: float = setting(1.0, "The distillation terms' weight against the RL loss.", ge=0, finite=True)
    only: bool = setting(False, "Pure distillation: the group advantage term off (no verifier signal).")
    signal: DistillSignal = setting(
        "both", "reverse_kl_sampled (a per-token advantage), topn_forward_kl (over the teacher's top-N), or both."
    )
    top_n: int = setting(8, "N of the teacher's top-N in topn_forward_kl.", ge=1)
    teacher_hf_dir: str = setting("", "teacher: the teacher's HF model directory.")
    template: str = setting(
        "Reference answer: {answer}\n\n",
        "self and crpo: the privileged context put before the sequence; {answer} is the reference answer (self) or "
        "a correct response of the group (crpo).",
        check=_answer_template,
        expect="a template holding {answer}, its only field",
    )
    crpo: CrpoConfig = setting(factory=CrpoConfig, doc="CRPO's knobs (kind = crpo).")


@dataclass
class ArmorConfig:
    """ARMOR (docs/algorithms.md, "ARMOR"): each group is G - 1 policy samples plus one anchor, a correct sample of the
    reference; the reference is reset to the policy every reset_every steps; the mixed ratio replaces rho."""

    anchors: bool = setting(
        False, "Each group gets its anchor: a correct sample of the reference among candidates of its samples."
    )
    candidates: int = setting(4, "Reference samples an anchor is chosen from.", ge=1)
    reset_every: int = setting(160, "Steps between resets of the reference to the policy.", ge=1)
    mixed_ratio_share: float | None = setting(
        None,
        "a of the mixed ratio (a pi + (1 - a) pi_ref) / (a pi_old + (1 - a) pi_ref) that replaces rho in every "
        "loss; null: the plain ratio, or with anchors the on-policy share (G - 1) / G.",
        gt=0,
        le=1,
    )


GroundTruthGroups = Literal["all", "unsolved"]


@dataclass
class GroundTruthConfig:
    """Ground-truth injection (docs/algorithms.md, "Ground-truth injection"; Anchor in Liu et al., arXiv 2511.09222):
    one group member of rollout.group_size = G is the prompt's reference solution, beside G - 1 policy samples,
    scored by the verifier and counted in the group's advantages and the loss like any sample."""

    enabled: bool = setting(
        False,
        "The prompt's reference solution is the last member of its group, beside G - 1 policy samples (a task whose "
        "rows carry answer.solution, or countdown; experience/methods/ground_truth.py).",
    )
    groups: GroundTruthGroups = setting(
        "all",
        "Where the reference joins: all groups (Anchor), or unsolved ones (no policy sample with reward >= 1); "
        "elsewhere its row trains nothing and the G - 1 policy samples' advantages are their own group's.",
    )


@dataclass
class AlgoConfig:
    """Advantages, the loss and the methods around it, by section."""

    loss: LossConfig = setting(factory=LossConfig, doc="The policy loss and its knobs.")
    advantage: AdvantageConfig = setting(factory=AdvantageConfig, doc="How rewards become advantages.")
    kl: KlConfig = setting(factory=KlConfig, doc="The KL term to the frozen reference, and PBA.")
    rollout_correction: RolloutCorrectionConfig = setting(
        factory=RolloutCorrectionConfig, doc="Reweighting for the engine's sampling policy."
    )
    distill: DistillConfig = setting(factory=DistillConfig, doc="On-policy distillation, and CRPO.")
    armor: ArmorConfig = setting(factory=ArmorConfig, doc="ARMOR's anchors and mixed ratio.")
    ground_truth: GroundTruthConfig = setting(
        factory=GroundTruthConfig, doc="Ground-truth injection: the reference solution in each group (Anchor)."
    )
    drop_uniform_groups: bool = setting(
        False, "DAPO dynamic sampling: groups whose rewards are all equal are dropped and refilled."
    )
    mask_truncated: bool = setting(
        False, "DAPO overlong filtering: a response cut at the token budget trains no tokens."
    )
    demonstrations: bool = setting(
        False,
        "SFT on demonstrations: every response is the prompt's reference solution (experience/methods/"
        "demonstrations.py; with advantage.kind reward or signed_reward).",
    )

    @property
    def mixes_ratio(self) -> bool:
        """Whether the loss uses ARMOR's mixed ratio (and so a reference that resets to the policy)."""
        return self.armor.anchors or self.armor.mixed_ratio_share is not None

    def mixed_ratio_share(self, group_size: int) -> float | None:
        """ARMOR's a for groups of ``group_size``: armor.mixed_ratio_share, or with anchors the on-policy share
        (G - 1) / G; None: the plain ratio."""
        if self.armor.mixed_ratio_share is not None or not self.armor.anchors:
            return self.armor.mixed_ratio_share
        return on_policy_share(group_size)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads a reference model: a KL term (a global coefficient, or PBA's on risky prompts), or
        ARMOR's mixed ratio."""
        pba = self.kl.pba
        return self.kl.coef > 0 or (pba.enabled and pba.coef > 0) or self.mixes_ratio
