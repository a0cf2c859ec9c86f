"""Per-GPU memory of a recipe's layout, as pure arithmetic of (Config, HF config, nodes, GPU memory).

Nothing here imports torch or megatron: the plan runs on a login node before a job is queued. Every byte count
follows from what the code of this project allocates (megatron_rlvr/actor/megatron_actor.py, rollout/vllm_engine.py):

- actor weights: this rank's parameters (the exact count megatron-core builds, ``stage_split``: dense parameters cut
  over TP x PP, a MoE model's experts over EP x ETP) x the parameter dtype (bf16 2 B on GPU, fp32 4 B on CPU);
- main grads: DDP's grad buffer, fp32 (``grad_reduce_in_fp32=True``), one value per local parameter, not sharded;
- optimizer: Adam's two fp32 moments plus fp32 main params when the model params are not fp32 (megatron keeps fp32
  params themselves as the main params), sharded with the distributed optimizer: dense parameters over DP x CP,
  experts over the expert-data-parallel ranks; none of the three divides by cp;
- the frozen reference (`AlgoConfig.needs_reference`: ``algo.kl.coef > 0``, PBA's coefficient, or ARMOR): a second
  copy of the weights, no grads, no optimizer (ARMOR's anchors are sampled by the rollout engine itself and its
  checkpoints also hold the reference: no other term);
- LoRA (``actor.lora``, plan/lora_terms.py): the frozen base's weights, the adapters' weights, and grads and
  optimizer state of the adapters alone; the reference is free (the base with the adapters off);
- the distillation teacher (teacher.py): ``algo.distill.kind: teacher`` holds the model of
  ``algo.distill.teacher_hf_dir`` at the actor's TP/PP (its own shapes, the parameter dtype, no grads, no optimizer;
  its no-grad pass is one layer at a time like the statistics pass); ``self`` and ``crpo`` hold a copy of the student
  unless the reference is that copy already (CRPO's EMA teacher is always a copy of its own); its pass's op records
  and gathered scores: plan/teacher_terms.py (``teacher_scores``, the statistics phase; under ``crpo`` the prefix is a
  response, so its sequences are up to two lengths long);
- activations of one micro-batch: the tensors each layer saves for backward (recompute and sequence-parallel aware;
  an MoE layer's router and experts, plan/parallel_terms.py), times the micro-batches the 1F1B schedule keeps in
  flight on a pipeline stage; the fused op's logits shard (kept for its in-place backward) and its per-token
  records. With context parallelism every per-token term is per CP rank (1/cp of each sequence); one attention
  layer's gathered K/V is whole-sequence; an MoE layer's dispatcher buffers are a one-layer working set;
- the colocated vLLM engine: ``gpu_memory_utilization`` x GPU memory while it generates (weights + KV cache + its
  workspace); asleep it keeps only the workspace (sleep mode frees weights and KV cache on the GPU; level 1 moves
  the weights to host memory, level 2 drops them).

This module reads a run's Config into a `Layout` and sums the terms into the peak of each phase of a step, per kind
of rank (`plan_layout`): whether it fits, and what breaks it. The terms themselves are arithmetic of (ModelDims,
Layout) in modules of their own: an actor rank's in plan/actor_terms.py, an engine's in plan/engine_terms.py, and
those of MoE and CP, LoRA and a teacher pass in plan/parallel_terms.py, plan/lora_terms.py and plan/teacher_terms.py.

Assumptions that were not measured here are named constants (below, and in the terms' modules). Sizes are in bytes;
GB means 10^9 bytes (plan/units.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.models.builder import attention_choice, padded_vocab_size
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.actor_terms import (
    activations,
    actor_static,
    largest_layer_bytes,
    logits_bytes,
    op_scratch_bytes,
)
from megatron_rlvr.plan.engine_terms import engine_components, in_flight_kv_note, kv_tokens
from megatron_rlvr.plan.lora_terms import largest_adapter_grad
from megatron_rlvr.plan.parallel_terms import cp_kv_bytes, dispatcher_bytes
from megatron_rlvr.plan.stage_params import teacher_dims
from megatron_rlvr.plan.teacher_terms import teacher_scores_bytes, teacher_top_n
from megatron_rlvr.plan.units import FP32, GB

# CUDA context, NCCL communicators and cuBLAS workspaces of one GPU process: an estimate (GPU only).
RUNTIME_BYTES = int(2.0 * GB)
# The components that are estimates (this one and plan/engine_terms.py's ENGINE_WORKSPACE_BYTES), not derived from
# the recipe and the model: `megatron-rlvr plan` marks them, as the host table marks its own.
ESTIMATED_PARTS = ("runtime", "engine_workspace")
# Kept free on every GPU for the caching allocator's fragmentation and what the estimates above miss.
HEADROOM_FRACTION = 0.05


@dataclass(frozen=True)
class Layout:
    """Everything the arithmetic reads from a run's Config and world, in one flat record (what --suggest varies)."""

    tp: int
    pp: int
    dp: int
    vpp: int | None = None
    cp: int = 1  # context-parallel size: each CP rank holds 1/cp of every sequence
    ep: int = 1  # expert-parallel size (MoE models)
    etp: int = 1  # expert tensor-parallel size
    sequence_parallel: bool = False
    recompute: str = "none"
    micro_tokens: int = 2048  # tokens of one packed micro-batch on one CP rank (or micro_batch_size x length / cp)
    max_seq_len: int = 2048  # the longest single sequence (attention is confined to a sequence)
    micro_batches: int = 1  # micro-batches per mini-batch on one DP rank (bounds the pipeline's in-flight count)
    distributed_optimizer: bool = True
    param_bytes: int = 2
    reference: bool = False
    teacher: str = ""  # kind=teacher: algo.distill.teacher_hf_dir, whose config.json gives the teacher's shapes
    teacher_copy: bool = False  # algo.distill.kind=self / crpo without a reference: one more copy of the student
    teacher_top_n: int = 0  # the teacher pass's top-N (algo.distill.top_n, or crpo_top_k); 0: no teacher
    teacher_seq_len: int = 0  # the longest privileged sequence the teacher scores
    top_n: int = 3
    divisible_by: int = 128
    engine_tp: int = 1
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 1
    placement: str = "colocated"
    engine_ranks: int = 0
    bucket_bytes: int = 256 * 1024**2
    gpu: bool = True  # GPU: TE flash attention, a CUDA runtime, a vLLM engine; CPU: unfused attention, none of those
    # what the engines keep in flight (separate placement): rollout.max_staleness, and the sequences of one step
    max_staleness: int = 0
    step_sequences: int = 0  # trainer.prompts_per_step x rollout.group_size
    # the actor's attention (models.builder.attention_choice; None: TE on a GPU, unfused on the CPU): see attention_kind
    attention: str | None = None
    lora_rank: int = 0  # actor.lora.rank (0: full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # actor.lora.targets
    lora_sync: str = "merged"  # actor.lora.sync: what the engines load

    @property
    def attention_kind(self) -> str:  # "te" and "sdpa" keep no score matrix, "unfused" does
        return self.attention or ("te" if self.gpu else "unfused")

    @classmethod
    def from_config(cls, cfg: Any, world_size: int, gpu: bool = True) -> Layout:
        """The layout of ``cfg`` on ``world_size`` ranks."""
        a, r = cfg.actor, cfg.rollout
        placement = r.placement
        engine_ranks = r.engine_ranks if placement == "separate" else 0
        actor_world = world_size - engine_ranks
        cp = a.cp
        dp = max(1, actor_world // (a.tp * a.pp * cp))
        budget = a.max_tokens_per_micro_batch  # tokens per CP rank
        # a sequence is never split across micro-batches: a budget below the longest sequence still holds one
        seq_share = math.ceil(r.max_model_len / cp)  # the longest sequence's tokens on one CP rank
        micro_tokens = max(budget, seq_share) if budget else a.micro_batch_size * seq_share
        sequences = cfg.trainer.prompts_per_step * r.group_size // max(1, cfg.trainer.mini_batches_per_step)
        per_rank_tokens = math.ceil(sequences / dp) * seq_share
        # ARMOR's mixed ratio reads a reference too (reset to the policy: a copy, never LoRA's base); its anchors come
        # from the rollout engine itself (experience/methods/armor.py), so they add no engine memory
        lora = a.lora
        reference = cfg.algo.needs_reference and lora is None  # LoRA's reference is the base, adapters off: free
        teacher = cfg.algo.distill.teacher_hf_dir if cfg.algo.distill.kind == "teacher" else ""
        ema_teacher = cfg.algo.distill.kind == "crpo" and cfg.algo.distill.crpo.teacher == "ema"  # never the reference
        if teacher:
            teacher_dims(teacher)  # a bad teacher directory fails here, naming the key
        return cls(
            teacher=teacher,
            teacher_copy=cfg.algo.distill.kind in ("self", "crpo") and (not reference or ema_teacher),
            teacher_top_n=teacher_top_n(cfg.algo),
            teacher_seq_len=r.max_model_len * (2 if cfg.algo.distill.kind == "crpo" else 1),
            attention=attention_choice(
                gpu and cfg.model.use_transformer_engine != "off", cfg.model.core_attention, cuda=gpu, cp=cp
            ),
            lora_rank=lora.rank if lora is not None else 0,
            lora_targets=tuple(lora.targets) if lora is not None else (),
            lora_sync=lora.sync if lora is not None else "merged",
            tp=a.tp,
            pp=a.pp,
            dp=dp,
            vpp=a.vpp,
            cp=cp,
            ep=a.ep,
            etp=a.etp,
            sequence_parallel=a.sequence_parallel,
            recompute=a.recompute,
            micro_tokens=micro_tokens,
            max_seq_len=r.max_model_len,
            micro_batches=max(1, math.ceil(per_rank_tokens / micro_tokens)),
            distributed_optimizer=a.use_distributed_optimizer,
            param_bytes=2 if a.bf16 else FP32,
            reference=reference,
            top_n=max(cfg.algo.loss.top_n, 3),
            divisible_by=cfg.model.make_vocab_size_divisible_by,
            engine_tp=r.tp,
            gpu_memory_utilization=r.gpu_memory_utilization,
            sleep_level=r.sleep_level,
            placement=placement,
            engine_ranks=engine_ranks,
            bucket_bytes=r.bucket_bytes,
            gpu=gpu,
            max_staleness=r.max_staleness,
            step_sequences=cfg.trainer.prompts_per_step * r.group_size,
        )


# ---------------------------------------------------------------------------------------------------------------
# Phases: the terms of plan/actor_terms.py and plan/engine_terms.py, summed


@dataclass
class RankPlan:
    """One kind of rank (an actor stage, or an engine rank): its components and the peak of each phase."""

    name: str
    components: dict[str, int]
    phases: dict[str, int]

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclass
class Plan:
    """The per-GPU memory of one layout: every kind of rank, and which one sets the peak."""

    layout: Layout
    gpu_memory: int
    ranks: list[RankPlan]
    headroom: int = 0  # bytes that must stay free for the plan to fit
    problems: list[str] = field(default_factory=list)  # reasons it cannot run that are not a byte total
    notes: list[str] = field(default_factory=list)  # what it runs with that is not a failure (e.g. KV for k in flight)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak(self) -> int:
        return self.worst.peak

    @property
    def fits(self) -> bool:
        return self.peak + self.headroom <= self.gpu_memory and not self.problems

    @property
    def over(self) -> int:
        """Bytes by which the peak (plus the headroom) exceeds the GPU; <= 0 when the bytes fit."""
        return self.peak + self.headroom - self.gpu_memory

    def breaker(self) -> tuple[str, int] | None:
        """The largest component of the phase that does not fit (None when it fits)."""
        if self.fits:
            return None
        worst = self.worst
        shown = {k: v for k, v in worst.components.items() if k in PHASE_PARTS[worst.peak_phase]}
        return max(shown.items(), key=lambda kv: kv[1])


# the components each phase adds up (the engine's share differs while it sleeps); every phase holds the actor's state
_HELD = ("actor_weights", "adapters", "actor_grads", "optimizer", "reference", "teacher")
_PASS = ("dispatcher", "cp_kv", "logits", "op_scratch", "runtime")
PHASE_PARTS: dict[str, tuple[str, ...]] = {
    "rollout": (*_HELD, "engine_weights", "kv_cache", "engine_workspace", "runtime"),
    "statistics": (*_HELD, "engine_workspace", "forward_working", "teacher_scores", *_PASS),
    "update": (*_HELD, "engine_workspace", "activations", "backward_working", *_PASS),
    "sync": (*_HELD, "engine_workspace", "engine_weights", "sync_buckets", "runtime"),
}
ENGINE_RANK_PARTS = ("engine_weights", "kv_cache", "engine_workspace", "runtime")


def actor_rank_plan(dims: ModelDims, lay: Layout, stage: int, gpu_memory: int) -> RankPlan:
    """An actor rank of pipeline stage ``stage``; with colocated engines it also holds its engine's share."""
    c = dict(actor_static(dims, lay, stage))
    last = stage == lay.pp - 1
    c["activations"] = activations(dims, lay, stage)
    # gradients of one layer's saved tensors while it runs backward (a bound: the same size as what it saved), and
    # the largest weight gradient before DDP's hook adds it into the fp32 main grad: a vocab shard (embedding or
    # output layer; megatron runs without gradient-accumulation fusion here)
    vocab_shard = padded_vocab_size(dims.vocab, lay.tp, lay.divisible_by) // lay.tp * dims.hidden
    largest_weight = max(
        vocab_shard, dims.hidden * 2 * dims.ffn // lay.tp, dims.hidden * 2 * dims.expert_ffn // lay.etp
    )
    if lay.lora_rank:  # the frozen base computes no weight gradient: an adapter's is the largest
        largest_weight = largest_adapter_grad(dims, lay)
    # one layer at a time: its saved tensors, and what it gathers while it runs (CP's K/V, the MoE dispatcher's rows)
    one_layer = largest_layer_bytes(dims, lay, recompute="none")
    c["dispatcher"] = dispatcher_bytes(dims, lay)
    c["cp_kv"] = cp_kv_bytes(dims, lay)
    c["backward_working"] = one_layer + largest_weight * lay.param_bytes
    c["forward_working"] = one_layer  # no-grad pass: one layer at a time
    if lay.teacher:  # the teacher's pass is one too, of its own layer width
        teacher_layer = largest_layer_bytes(teacher_dims(lay.teacher), lay, recompute="none")
        c["forward_working"] = max(c["forward_working"], teacher_layer)
    c["logits"] = logits_bytes(dims, lay) if last else 0
    c["op_scratch"] = op_scratch_bytes(lay) if last else 0
    c["teacher_scores"] = teacher_scores_bytes(dims.vocab, lay.teacher_top_n, lay.step_sequences, lay.teacher_seq_len)
    c["runtime"] = RUNTIME_BYTES if lay.gpu else 0
    colocated = lay.placement != "separate" and lay.gpu
    engine = engine_components(dims, lay, gpu_memory) if colocated else {}
    c["engine_weights"] = engine.get("engine_weights", 0)
    c["kv_cache"] = engine.get("kv_cache", 0)
    c["engine_workspace"] = engine.get("engine_workspace", 0)
    # export: a TP-gathered bucket and the bucket handed over (the bridge bounds both by rollout.bucket_bytes)
    c["sync_buckets"] = 2 * lay.bucket_bytes if lay.gpu else 0
    phases = {name: sum(c[k] for k in parts) for name, parts in PHASE_PARTS.items()}
    if not colocated:
        phases["sync"] -= c["engine_weights"]  # the engine's weights live on the engine ranks
    return RankPlan(f"actor stage {stage}" if lay.pp > 1 else "actor", c, phases)


def engine_rank_plan(dims: ModelDims, lay: Layout, gpu_memory: int) -> RankPlan:
    """A rank of separate placement's engines: only its engine, generating while the actor trains."""
    c = engine_components(dims, lay, gpu_memory)
    c = {k: c[k] for k in ("engine_weights", "kv_cache", "engine_workspace")}
    c["runtime"] = RUNTIME_BYTES
    return RankPlan("engine rank", c, {"rollout": sum(c.values())})


def plan_layout(dims: ModelDims, lay: Layout, gpu_memory_gb: float, headroom_gb: float | None = None) -> Plan:
    """The plan of one layout: every pipeline stage's actor rank (and the engine ranks when separate). It fits when
    the highest peak leaves ``headroom_gb`` free (default: HEADROOM_FRACTION of the GPU; none on CPU)."""
    gpu_memory = int(gpu_memory_gb * GB)
    if headroom_gb is None:
        headroom_gb = HEADROOM_FRACTION * gpu_memory_gb if lay.gpu else 0.0
    ranks = [actor_rank_plan(dims, lay, s, gpu_memory) for s in range(lay.pp)]
    plan = Plan(lay, gpu_memory, ranks, headroom=int(headroom_gb * GB))
    held = max(r.components.get("teacher", 0) for r in ranks)
    if held and plan.over > 0 and plan.over <= held:  # it is the teacher that does not fit
        key = f"algo.distill.teacher_hf_dir={lay.teacher!r}" if lay.teacher else "algo.distill.kind=self"
        plan.problems.append(
            f"{key}: the teacher's weights, {held / GB:.1f} GB per GPU at TP={lay.tp} PP={lay.pp}, do not fit beside "
            f"the student (peak {(plan.peak + plan.headroom) / GB:.1f} GB with headroom, of {gpu_memory / GB:.1f} GB;"
            f" {(plan.peak + plan.headroom - held) / GB:.1f} GB without the teacher): raise actor.tp / actor.pp"
        )
    if lay.gpu and (lay.placement != "separate" or lay.engine_ranks):
        engine = engine_components(dims, lay, gpu_memory)
        if lay.placement == "separate":
            plan.ranks.append(engine_rank_plan(dims, lay, gpu_memory))
        held = kv_tokens(dims, lay, engine["kv_cache"])
        if held < lay.max_seq_len:
            plan.problems.append(
                f"kv_cache: {engine['kv_cache'] / GB:.1f} GB holds {held} tokens, fewer than one sequence of "
                f"rollout.max_model_len={lay.max_seq_len} (vLLM refuses to start)"
            )
        if lay.placement == "separate" and lay.step_sequences:
            plan.notes.append(in_flight_kv_note(dims, lay, engine["kv_cache"]))
    return plan


def plan_config(
    cfg: Any,
    hf: Mapping[str, Any],
    nodes: int,
    gpu_memory_gb: float = 141.0,
    gpus_per_node: int = 8,
    headroom_gb: float | None = None,
) -> Plan:
    """The plan of ``cfg`` on ``nodes`` nodes of ``gpus_per_node`` GPUs with ``gpu_memory_gb`` each."""
    lay = Layout.from_config(cfg, nodes * gpus_per_node, gpu=True)
    return plan_layout(ModelDims.from_hf(hf), lay, gpu_memory_gb, headroom_gb)
