"""Configuration of advantages and the policy loss (see docs/algorithms.md for every knob's meaning).

Plain data; ``__post_init__`` only checks ranges so a bad recipe fails at load time with the key's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

LossName = Literal[
    "grpo", "casp", "entropy_bonus", "entropy_adv", "kl_cov", "clip_cov", "w_reinforce", "psr", "nsr", "forking_tokens"
]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
RolloutCorrection = Literal["none", "tis", "mis", "icepop"]
DistillMode = Literal["none", "teacher", "self", "crpo"]
DISTILL_MODES: tuple[str, ...] = get_args(DistillMode)
DistillSignal = Literal["reverse_kl_sampled", "topn_forward_kl", "both"]
DISTILL_SIGNALS: tuple[str, ...] = get_args(DistillSignal)
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)
ADVANTAGES: tuple[str, ...] = ("group", "reward", "signed_reward")


@dataclass
class AlgoConfig:
    loss: LossName = "casp"
    # advantages
    normalize_std: bool = True  # false = Dr.GRPO (A = r - mean)
    adv_eps: float = 1e-6
    drop_uniform_groups: bool = False  # DAPO dynamic sampling: all-equal groups are dropped and refilled
    mask_truncated: bool = False  # DAPO overlong filtering: a response cut at the token budget trains no tokens
    # PPO clip and aggregation
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_agg: LossAgg = "token_mean"
    max_len_norm: int = 1024  # the constant of seq_mean_token_sum_norm
    kl_coef: float = 0.0  # k3 KL to a frozen reference; 0 = no reference model
    # rollout correction: rho = exp(old_logp - engine logp) reweights w (docs/algorithms.md, "Rollout correction")
    rollout_correction: RolloutCorrection = "none"
    rollout_correction_level: Literal["token", "sequence"] = "token"
    rollout_is_cap: float = 2.0  # tis: C, the truncation of the weight
    rollout_is_low: float = 0.5  # mis / icepop: the kept band [low, high] of rho
    rollout_is_high: float = 2.0
    # CaSP (also: tau_q is the high-entropy quantile of forking_tokens)
    top_n: int = 3
    alpha: float = 0.05  # label-smoothing share moved onto the top-N candidates (positive samples)
    lambda_top1: float = 0.5  # extra penalty on wrong tokens that are rank 1 (negative samples)
    tau_q: float = 0.8  # per-response entropy quantile; 0 = every response token
    weights: Literal["uniform", "softmax"] = "uniform"
    apply_to: Literal["both", "positive", "negative"] = "both"
    # adaptive candidate sets (docs/algorithms.md, "Adaptive candidates"): the smallest top-ranked set reaching candidate_mass of
    # the probability, at most top_n, replaces the fixed top-N of CaSP's positive smoothing
    candidates: Literal["fixed", "adaptive"] = "fixed"
    candidate_mass: float = 0.9
    # PBA, per-problem base anchoring: M frozen-base samples per training prompt (drawn once, stored in the run
    # directory); prompts with fewer than pba_min_correct correct ones get the k3 KL to the base with pba_kl_coef
    pba: bool = False
    pba_base_samples: int = 16
    pba_min_correct: int = 2
    pba_kl_coef: float = 0.1
    # on-policy distillation (docs/distillation.md, algos/distill.py): a frozen teacher scores the
    # student's sampled responses; teacher = the model of teacher_hf_dir (same tokenizer), self = the frozen initial
    # policy reading self_distill_template (the reference answer before the prompt)
    distill: DistillMode = "none"
    distill_coef: float = 1.0  # weight of the distillation terms against the RL loss
    distill_only: bool = False  # pure distillation: the group advantage term off (no verifier signal)
    distill_signal: DistillSignal = "both"  # reverse_kl_sampled (per-token advantage), topn_forward_kl, or both
    distill_top_n: int = 8  # N of the teacher's top-N in topn_forward_kl
    teacher_hf_dir: str = ""
    self_distill_template: str = "Reference answer: {answer}\n\n"
    # CRPO (docs/distillation.md, algos/crpo.py; algo.distill=crpo): the initial policy (frozen, or an EMA of the
    # policy) reading a correct response of the same group (in self_distill_template's {answer}) scores the
    # responses; a group-coupled contrastive term over the teacher's top-K support replaces the distillation signals
    crpo_top_k: int = 100  # K of the teacher's top-K support (capped at the vocabulary)
    crpo_positive_share: float = 0.3  # p: the share of a group's positions with the lowest dE that form P
    crpo_tau: float = 1.0  # temperature of the contrast's softmax over sim
    crpo_coef: float = 5.0  # lambda: loss = RL loss + crpo_coef * L_CRPO
    crpo_correct_reward: float = 1.0  # a response is correct (a privileged context) when its reward is at least this
    crpo_teacher: Literal["frozen", "ema"] = "frozen"  # the initial policy, or an EMA of the policy (checkpointed)
    crpo_ema_decay: float = 0.1  # ema: after every optimizer step, teacher = decay * teacher + (1 - decay) * policy
    # baselines
    beta: float = 0.01  # entropy_bonus / entropy_adv / kl_cov coefficient
    kappa: float = 2.0  # entropy_adv cap |A| / kappa
    cov_fraction: float = 0.002  # kl_cov / clip_cov: fraction k of the tokens selected (at least one)
    lambda_pos: float = 0.1  # w_reinforce: weight of positive samples
    # ARMOR and the SFT-to-RL grid (docs/algorithms.md, "ARMOR" and "The SFT-to-RL grid")
    # anchor_rollout: each group is G - 1 policy samples plus one anchor, a correct sample of the reference pi_ref
    # found among anchor_candidates pi_ref samples; pi_ref is reset to the policy every anchor_reset_every steps
    anchor_rollout: bool = False
    anchor_candidates: int = 4
    anchor_reset_every: int = 160
    # a of the mixed ratio (a pi + (1 - a) pi_ref) / (a pi_old + (1 - a) pi_ref) that replaces rho in every loss;
    # None: the plain ratio, or under anchor_rollout the on-policy share (G - 1) / G (set by the run's Config)
    mixed_ratio_share: float | None = None
    # advantage: group (GRPO / Dr.GRPO by normalize_std), reward (A = r: REINFORCE without a baseline; with psr, NLL
    # on the rewarded samples, rejection-sampling fine-tuning), signed_reward (A = 2r - 1: +-1 for 0/1 rewards)
    advantage: Literal["group", "reward", "signed_reward"] = "group"
    # demonstrations: every response is the prompt's reference solution (SFT's off-policy data; experience/methods/demonstrations.py)
    demonstrations: bool = False

    def __post_init__(self) -> None:
        def bad(key: str, expected: str) -> ValueError:
            return ValueError(f"algo.{key}: expected {expected}, got {getattr(self, key)!r}")

        if self.loss not in LOSS_NAMES:
            raise ValueError(f"algo.loss: got {self.loss!r}; allowed values: {', '.join(LOSS_NAMES)}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"algo.loss_agg: got {self.loss_agg!r}; allowed values: {', '.join(LOSS_AGGS)}")
        if self.weights not in ("uniform", "softmax"):
            raise bad("weights", "'uniform' or 'softmax'")
        if self.apply_to not in ("both", "positive", "negative"):
            raise bad("apply_to", "'both', 'positive' or 'negative'")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"algo.rollout_correction: got {self.rollout_correction!r}; allowed values: "
                f"{', '.join(ROLLOUT_CORRECTIONS)}"
            )
        if self.rollout_correction_level not in ("token", "sequence"):
            raise bad("rollout_correction_level", "'token' or 'sequence'")
        # rho = 1 (engine and actor agree) must keep weight 1, so every correction is the identity on-policy
        if not self.rollout_is_cap >= 1:
            raise bad("rollout_is_cap", ">= 1 (a weight of 1 must stay untruncated)")
        if not 0 <= self.rollout_is_low <= 1:
            raise bad("rollout_is_low", "in [0, 1] (rho = 1 must stay inside the kept band)")
        if not self.rollout_is_high >= 1:
            raise bad("rollout_is_high", ">= 1 (rho = 1 must stay inside the kept band)")
        if not self.adv_eps >= 0:
            raise bad("adv_eps", ">= 0")
        for key in ("eps_low", "eps_high", "kl_coef", "lambda_top1", "beta", "lambda_pos"):
            if not getattr(self, key) >= 0:
                raise bad(key, ">= 0")
        if not self.eps_low < 1:
            raise bad("eps_low", "< 1 (the ratio's lower clip bound 1 - eps_low must stay positive)")
        if self.max_len_norm < 1:
            raise bad("max_len_norm", ">= 1")
        if self.top_n < 1:
            raise bad("top_n", ">= 1")
        if not 0 <= self.alpha <= 1:
            raise bad("alpha", "a share in [0, 1]")
        if not 0 <= self.tau_q < 1:
            raise bad("tau_q", "a quantile in [0, 1)")
        if self.candidates not in ("fixed", "adaptive"):
            raise bad("candidates", "'fixed' or 'adaptive'")
        if not 0 < self.candidate_mass <= 1:
            raise bad("candidate_mass", "a probability share in (0, 1]")
        if self.pba_base_samples < 1:
            raise bad("pba_base_samples", ">= 1")
        if not 0 <= self.pba_min_correct <= self.pba_base_samples:
            raise bad("pba_min_correct", f"in [0, pba_base_samples={self.pba_base_samples}]")
        if not self.pba_kl_coef >= 0:
            raise bad("pba_kl_coef", ">= 0")
        if self.distill not in DISTILL_MODES:
            raise ValueError(f"algo.distill: got {self.distill!r}; allowed values: {', '.join(DISTILL_MODES)}")
        if self.distill_signal not in DISTILL_SIGNALS:
            raise ValueError(
                f"algo.distill_signal: got {self.distill_signal!r}; allowed values: {', '.join(DISTILL_SIGNALS)}"
            )
        if not (self.distill_coef >= 0 and self.distill_coef < float("inf")):
            raise bad("distill_coef", "a finite number >= 0")
        if self.distill_top_n < 1:
            raise bad("distill_top_n", ">= 1")
        if self.distill_only and self.distill == "none":
            raise bad("distill_only", "false under algo.distill=none (there is no teacher to distill from)")
        if self.distill == "teacher" and not self.teacher_hf_dir:
            raise bad("teacher_hf_dir", "the teacher's HF model directory under algo.distill=teacher")
        if self.distill in ("self", "crpo"):
            try:
                self.self_distill_template.format(answer="")
            except (KeyError, IndexError, ValueError) as e:
                raise bad("self_distill_template", f"a template whose only field is {{answer}} ({e!r})") from None
            if "{answer}" not in self.self_distill_template:
                raise bad("self_distill_template", "a template holding {answer} (the privileged context)")
        if self.crpo_top_k < 1:
            raise bad("crpo_top_k", ">= 1")
        if not 0 < self.crpo_positive_share <= 1:
            raise bad("crpo_positive_share", "a share in (0, 1] (the positive set must hold at least one position)")
        if not (self.crpo_tau > 0 and self.crpo_tau < float("inf")):
            raise bad("crpo_tau", "a finite temperature > 0")
        if not (self.crpo_coef >= 0 and self.crpo_coef < float("inf")):
            raise bad("crpo_coef", "a finite number >= 0")
        if not abs(self.crpo_correct_reward) < float("inf"):
            raise bad("crpo_correct_reward", "a finite reward")
        if self.crpo_teacher not in ("frozen", "ema"):
            raise bad("crpo_teacher", "'frozen' or 'ema'")
        if not 0 <= self.crpo_ema_decay <= 1:
            raise bad("crpo_ema_decay", "a decay in [0, 1]")
        if self.distill == "crpo" and self.distill_only:
            raise bad("distill_only", "false under algo.distill=crpo (CRPO is added to the RL loss: crpo_coef)")
        if not self.kappa > 0:
            raise bad("kappa", "> 0")
        if not 0 <= self.cov_fraction <= 1:
            raise bad("cov_fraction", "a fraction in [0, 1]")
        # ARMOR and the SFT-to-RL grid
        if self.anchor_candidates < 1:
            raise bad("anchor_candidates", ">= 1 (the reference samples an anchor is chosen from)")
        if self.anchor_reset_every < 1:
            raise bad("anchor_reset_every", ">= 1 (steps between resets of the reference to the policy)")
        share = self.mixed_ratio_share
        if share is not None and not 0 < share <= 1:
            raise bad("mixed_ratio_share", "a share in (0, 1] (a of the mixed ratio; null = the plain ratio)")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"algo.advantage: got {self.advantage!r}; allowed values: {', '.join(ADVANTAGES)}")
        if self.demonstrations and self.advantage == "group":
            raise bad(
                "advantage",
                "'reward' or 'signed_reward' under algo.demonstrations (a group of one "
                "demonstration has group advantages 0)",
            )
        if self.demonstrations and self.anchor_rollout:
            raise bad("demonstrations", "false under algo.anchor_rollout (the anchors join policy samples)")
        if self.anchor_rollout or share is not None:
            for key, off in (("kl_coef", 0), ("pba", False), ("distill", "none"), ("rollout_correction", "none")):
                if getattr(self, key) != off:
                    raise bad(
                        key,
                        f"{off!r} under ARMOR (algo.anchor_rollout / algo.mixed_ratio_share): its reference is reset "
                        "to the policy, and the mixed ratio is its only use of it",
                    )
