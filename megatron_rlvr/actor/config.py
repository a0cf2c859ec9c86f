"""Configuration of the Megatron actor: parallel layout, micro-batching, optimizer and memory knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rlvr.models.layout import ParallelLayout
from megatron_rlvr.models.lora import TARGETS, AdapterSpec, check_spec


@dataclass
class LoraConfig:
    """LoRA on the actor (docs/lora.md): the base is frozen, adapters of rank ``rank`` on the ``targets`` linears
    train, and the KL reference is the base with the adapters off."""

    rank: int = 8
    alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input, in training passes
    # megatron-core's names of the adapted linears; "experts": every routed expert's linear_fc1 and linear_fc2
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    # what the engines load after each update: "merged" (W + alpha/r B A, in the existing weight stream) or
    # "adapters" (the adapter alone, loaded by vLLM's LoRA under a new name each sync)
    sync: Literal["merged", "adapters"] = "merged"
    seed: int = 0  # the adapters' init (A drawn per linear from this seed and its name; B = 0)

    def __post_init__(self) -> None:
        check_spec(self.rank, self.alpha, self.dropout, self.targets)

    def spec(self) -> AdapterSpec:
        return AdapterSpec(self.rank, self.alpha, self.dropout, tuple(self.targets))


@dataclass
class ActorConfig:
    """Megatron actor: parallel layout, optimizer and the memory knobs a large run needs."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    # Mixture-of-experts models only (docs/moe.md): experts are spread over ep expert-parallel ranks, each expert's
    # weights cut over etp expert-tensor-parallel ranks; ep * etp must divide dp * cp * tp, and ep the experts.
    ep: int = 1
    etp: int = 1
    # The router's load-balancing loss. 0 by default: RL fine-tunes a trained router whose balance pretraining
    # already set, the objective should be the policy loss alone, and a balancing term would pull the routing (and
    # so the log-probs the importance ratios compare) away from the rollout's.
    moe_aux_loss_coeff: float = 0.0
    # Routing replay for MoE models (docs/routing-replay.md): "train" records each MoE layer's top-k experts per token in the
    # step's first pass and replays them in every later pass; "rollout" replays the engine's own routing, carried
    # with the tokens (Sequences.routed_experts).
    router_replay: Literal["none", "train", "rollout"] = "none"
    # Context-parallel size (docs/context-parallel.md): every packed sequence is cut over cp ranks.
    cp: int = 1
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    micro_batch_size: int = 1  # sequences per micro-batch when max_tokens_per_micro_batch is 0
    # > 0: micro-batches by real-token budget (micro_batch_size unused); a longer sequence gets a micro-batch alone
    max_tokens_per_micro_batch: int = 0
    pack_sequences: bool = True  # one THD stream per micro-batch (no padding); false: right-padded [b, S] blocks
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    use_distributed_optimizer: bool = True
    bf16: bool = False  # bf16 compute with fp32 main grads and params in the optimizer
    stats_chunk_tokens: int = 4096  # token chunk of the fused statistics op (bounds its scratch memory)
    max_nonfinite_in_a_row: int = 3
    lora: LoraConfig | None = None  # LoRA adapters on a frozen base (docs/lora.md); null: full fine-tuning

    def layout(self) -> ParallelLayout:
        """The parallel layout these sizes make (its rules: models/layout.py)."""
        return ParallelLayout(
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            cp=self.cp,
            ep=self.ep,
            etp=self.etp,
            sequence_parallel=self.sequence_parallel,
            pack_sequences=self.pack_sequences,
        )
