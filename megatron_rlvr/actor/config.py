"""Configuration of the Megatron actor: parallel layout, micro-batching, optimizer and memory knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rlvr.models.layout import ParallelLayout
from megatron_rlvr.models.lora import TARGETS, AdapterSpec
from megatron_rlvr.settings import setting


@dataclass
class LoraConfig:
    """LoRA on the actor (docs/lora.md): the base is frozen, adapters of rank ``rank`` on the ``targets`` linears
    train, and the KL reference is the base with the adapters off. The adapters' limits are their spec's
    (models/lora.py `check_spec`), checked when the recipe loads."""

    rank: int = setting(8, "The adapters' rank r (>= 1).")
    alpha: float = setting(16.0, "The adapters' update is scaled by alpha / rank (> 0).")
    dropout: float = setting(0.0, "Dropout on the adapters' input, in training passes (in [0, 1)).")
    targets: list[str] = setting(
        factory=lambda: list(TARGETS),
        doc=f"megatron-core's names of the adapted linears, some of {list(TARGETS)}; experts: every routed expert's "
        "linear_fc1 and linear_fc2.",
    )
    sync: Literal["merged", "adapters"] = setting(
        "merged",
        "What the engines load after each update: merged (W + alpha/r B A, in the existing weight stream) or "
        "adapters (the adapter alone, loaded by vLLM's LoRA under a new name each sync).",
    )
    seed: int = setting(0, "The adapters' init: A drawn per linear from this seed and its name; B = 0.")

    def spec(self) -> AdapterSpec:
        return AdapterSpec(self.rank, self.alpha, self.dropout, tuple(self.targets))


@dataclass
class ActorConfig:
    """Megatron actor: parallel layout, optimizer and the memory knobs a large run needs."""

    # the parallel sizes' rules (against each other, the world size and the model's shapes) are the layout's, in one
    # home: models/layout.py `ParallelLayout.problems`, which the config, the plan and the builder run
    tp: int = setting(1, "Tensor-parallel size.")
    pp: int = setting(1, "Pipeline-parallel size.")
    vpp: int | None = setting(None, "Virtual pipeline stages per rank (the interleaved schedule); null: none.")
    ep: int = setting(
        1,
        "Mixture-of-experts models (docs/moe.md): experts are spread over ep expert-parallel ranks; ep * etp must "
        "divide dp * cp * tp, and ep the experts.",
    )
    etp: int = setting(1, "Each expert's weights cut over etp expert-tensor-parallel ranks.")
    moe_aux_loss_coeff: float = setting(
        0.0,
        "The router's load-balancing loss. 0 by default: RL fine-tunes a trained router whose balance pretraining "
        "already set, and a balancing term would pull the routing (so the log-probs the ratios compare) away from "
        "the rollout's.",
        ge=0,
    )
    router_replay: Literal["none", "train", "rollout"] = setting(
        "none",
        "Routing replay for MoE models (docs/routing-replay.md): train records each MoE layer's top-k experts per "
        "token in the step's statistics pass and replays them in every later pass; rollout replays the engine's own "
        "routing, carried with the tokens (Rollouts.routed_experts).",
    )
    cp: int = setting(
        1, "Context-parallel size (docs/context-parallel.md): every packed sequence is cut over cp ranks."
    )
    sequence_parallel: bool = setting(False, "Megatron's sequence parallelism over the TP ranks.")
    recompute: Literal["none", "selective", "full"] = setting("none", "Activation recomputation.")
    micro_batch_size: int = setting(1, "Sequences per micro-batch when max_tokens_per_micro_batch is 0.", ge=1)
    max_tokens_per_micro_batch: int = setting(
        0,
        "> 0: micro-batches by real-token budget (micro_batch_size unused); a longer sequence gets a micro-batch "
        "alone. 0: micro_batch_size sequences.",
        ge=0,
    )
    pack_sequences: bool = setting(
        True, "One THD stream per micro-batch (no padding); false: right-padded [b, S] blocks (docs/packing.md)."
    )
    lr: float = setting(1e-6, "Adam's learning rate (peak, after warm-up).", ge=0)
    min_lr: float = setting(0.0, "The learning rate the decay ends at.", ge=0)
    lr_warmup_steps: int = setting(0, "Optimizer steps of linear warm-up.", ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = setting("constant", "The decay after warm-up.")
    weight_decay: float = setting(0.0, "Adam's decoupled weight decay.", ge=0)
    adam_beta1: float = setting(0.9, "Adam's beta1.", ge=0, lt=1)
    adam_beta2: float = setting(0.999, "Adam's beta2.", ge=0, lt=1)
    adam_eps: float = setting(1e-8, "Adam's epsilon.", gt=0)
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this (0 = no clipping).", ge=0)
    use_distributed_optimizer: bool = setting(True, "Shard the optimizer state over the data-parallel ranks.")
    bf16: bool = setting(False, "bf16 compute with fp32 main grads and params in the optimizer.")
    stats_chunk_tokens: int = setting(4096, "Token chunk of the fused statistics op (bounds its scratch memory).", ge=1)
    max_nonfinite_in_a_row: int = setting(
        3, "Steps in a row with a non-finite loss or gradient (each skipped) before the run stops.", ge=0
    )
    lora: LoraConfig | None = setting(None, "LoRA adapters on a frozen base (docs/lora.md); null: full fine-tuning.")

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
