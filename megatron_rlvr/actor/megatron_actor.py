"""MegatronActor: a megatron-core policy (any TP/PP/VPP/CP/EP) with its optimizer, the loop's `protocols.Actor`: it
scores rollouts (behaviour log-probs, the frozen reference's, the teacher's: its `Statistics`), updates on them,
exports its weights and hands its state to checkpoints. It writes into nothing it is given (protocols/handoffs.py).

The actor sees rollouts as `Rollouts` (prompt + response token ids, right-padded, a mask of the response positions,
the engine's log-probs, the rewards) with their `Targets` (per-sequence advantages); the update joins them with the
statistics into its own `TrainingRows` (rows.py). Every loss reads only the fused op's per-token statistics, computed
on the last pipeline stage from the vocab-sharded logits. Loss scaling: `policy_loss` normalizes by the global token /
sequence counts of the whole mini-batch, and the schedule's `/ num_microbatches` and DDP's `/ dp` are undone here, so
the gradient is exactly that of the mini-batch loss whatever the micro-batching and data parallelism.

Every pass (the policy's, the reference's, the teacher's, routing replay's comparison) runs through one
`ActorPasses` (passes.py): the same mini-batches (``score`` plans each of the update's on its own), the same plan over
DP ranks and micro-batches (packing.py), the same THD streams with ``pack_sequences`` (``PackedSeqParams``: TE's
attention on GPU, runtime/cpu/attention.py without TE), the fused op's per-token outputs put back into the
right-padded [b, S - 1] view the losses read; so no loss knows whether a batch was packed, packing changes no number
beyond float rounding, and a frozen copy with the policy's weights computes the policy's numbers bit for bit.
With ``actor.cp > 1`` (docs/context-parallel.md) each CP rank runs its share of every sequence (packing.py's split),
the op's per-token outputs are gathered over CP (actor/context_parallel.py), and every CP rank computes the identical
whole micro-batch loss; its gradient share is summed over DP x CP by megatron's DDP.

With ``algo.kl.coef > 0`` (or PBA with ``algo.kl.pba.coef > 0``) the actor also holds a frozen reference policy (the
same chunks, loaded from the same initial weights, never trained) whose log-probs feed the loss's k3 KL term; without
it nothing extra is built. With ``actor.lora`` (actor/lora.py, docs/lora.md) the base is frozen, adapters train, and
the reference is the policy's own chunks with the adapters off: no copy is built. ``Targets.kl_coef`` (PBA) gives
that term's coefficient per sequence. With ``algo.distill.kind`` the actor also holds a frozen teacher
(actor/teacher.py), scored beside the reference; its scores travel in ``Statistics.teacher`` into the loss's
distillation terms. Under ``algo.distill.kind: crpo`` each mini-batch
first runs a forward-only pass of the policy (actor/contrast.py) for CRPO's group-coupled weights, then its update.
With ``actor.router_replay`` (MoE models, docs/routing-replay.md) every forward routes each token to the experts its
statistics pass recorded (``Statistics.routed_experts``) or its engine chose (``Rollouts.routed_experts``;
actor/router_replay.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlvr.actor.chunks import build_chunks, freeze
from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.actor.contrast import contrast_weights
from megatron_rlvr.actor.gathering import across_data_parallel, from_last_stage
from megatron_rlvr.actor.lora import LoraPolicy
from megatron_rlvr.actor.optimizer import build_optimizer, load_schedule, prepare_for_load, restore_torch_adam_steps
from megatron_rlvr.actor.packing import MicroBatch, mini_batch_rows
from megatron_rlvr.actor.passes import ActorPasses
from megatron_rlvr.actor.router_replay import RouterReplayer
from megatron_rlvr.actor.rows import TrainingRows
from megatron_rlvr.actor.teacher import build_teacher, student_logits_at
from megatron_rlvr.algos import policy_loss
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.metrics import (
    combine_micro_batches,
    finish_subset_means,
    logp_mismatch,
    summed_over_data_parallel,
)
from megatron_rlvr.data import PromptItem
from megatron_rlvr.models.config import ModelConfig
from megatron_rlvr.protocols.actor import WeightBucket
from megatron_rlvr.protocols.handoffs import Rollouts, Sequences, Statistics, Targets
from megatron_rlvr.runtime import callbacks, distributed


class MegatronActor:
    """The policy on this rank: its DDP-wrapped chunks, optimizer and schedule, the frozen reference and teacher when
    the loss needs them, and the passes they all run through (``passes``)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        actor_cfg: ActorConfig,
        algo_cfg: AlgoConfig,
        *,
        temperature: float,
        total_steps: int,
        group_size: int | None = None,
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        from megatron_rlvr.models import load_hf_config, padded_vocab_size, transformer_config_from_hf
        from megatron_rlvr.models.builder import resolve_use_te
        from megatron_rlvr.models.dims import ModelDims

        self.cfg, self.algo_cfg = actor_cfg, algo_cfg
        if algo_cfg.armor.anchors and group_size is None:
            raise ValueError("MegatronActor: algo.armor.anchors needs group_size (the rollout's responses per prompt)")
        # ARMOR's a of the mixed ratio, which the loss reads (None: the plain ratio)
        self.mixed_ratio_share = algo_cfg.mixed_ratio_share(group_size or 1)
        self.hf = load_hf_config(model_cfg.hf_dir)
        actor_cfg.layout().check(ModelDims.from_hf(self.hf))  # the rules Config.validate ran; a direct build too
        dtype = torch.bfloat16 if actor_cfg.bf16 else torch.float32
        self.tcfg = transformer_config_from_hf(
            self.hf,
            tp=actor_cfg.tp,
            pp=actor_cfg.pp,
            vpp=actor_cfg.vpp,
            params_dtype=dtype,
            sequence_parallel=actor_cfg.sequence_parallel,
            recompute=actor_cfg.recompute,
            ep=actor_cfg.ep,
            etp=actor_cfg.etp,
            moe_aux_loss_coeff=actor_cfg.moe_aux_loss_coeff,
            cp=actor_cfg.cp,
            # micro-batches differ in length (packed streams, token budgets): stages exchange each one's shape. Not
            # under the interleaved schedule: megatron-core's shape exchange posts its sends to the previous and the
            # next stage in one order and its receives in that order too, so at PP=2 (both are one rank) the
            # combined exchanges of the interleaved steady state swap the two shapes. There every packed stream is
            # padded to one length instead (passes.py).
            variable_seq_lengths=actor_cfg.pp > 1 and not actor_cfg.vpp,
        )
        # the schedules call it after the last backward: DP grad reduce(-scatter) and tied-embedding sync over PP
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.replay = RouterReplayer(actor_cfg.router_replay, self.tcfg)  # before any router is built
        use_te = resolve_use_te(model_cfg.use_transformer_engine)
        initial = partial(
            build_chunks,
            self.hf,
            self.tcfg,
            vpp=actor_cfg.vpp,
            use_te=use_te,
            core_attention=model_cfg.core_attention,
            attention_block_tokens=model_cfg.packed_attention_block_tokens,
            divisible_by=model_cfg.make_vocab_size_divisible_by,
            hf_dir=model_cfg.hf_dir,
            dist_checkpoint=model_cfg.load,
        )
        chunks = initial()
        # actor.lora: the base frozen, adapters on the chunks; the reference is then these chunks with them off
        self.lora = LoraPolicy(chunks, actor_cfg.lora, model_cfg.hf_dir, model_cfg.load) if actor_cfg.lora else None
        if self.lora is not None:
            self.tcfg.finalize_model_grads_func = self.lora.finalize_grads(finalize_model_grads)
        # The KL term's frozen reference: the same initial weights, never trained. Checkpoints do not hold it: a
        # resumed run rebuilds it from the same initial weights, which is the reference it had. ARMOR's reference
        # (algo.armor.mixed_ratio_share) is reset to the policy (reset_reference), so checkpoints hold that one.
        separate = algo_cfg.needs_reference and self.lora is None
        self.reference: list[torch.nn.Module] | None = freeze(initial()) if separate else None
        self.replay.install(chunks, self.reference)  # actor.router_replay hooks on both models' routers
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=actor_cfg.use_distributed_optimizer,
            overlap_grad_reduce=False,
        )
        self.model = [DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=c) for c in chunks]
        self.optimizer, self.scheduler = build_optimizer(self.model, actor_cfg, total_steps)
        vocab_size = int(self.hf["vocab_size"])
        self.passes = ActorPasses(
            actor_cfg,
            self.tcfg,
            vocab_size=vocab_size,
            local_vocab=padded_vocab_size(vocab_size, actor_cfg.tp, model_cfg.make_vocab_size_divisible_by)
            // actor_cfg.tp,
            temperature=temperature,
            replay=self.replay,
        )
        # algo.distill.kind: a frozen teacher beside the reference (teacher.py), scored through the same passes
        self.teacher = build_teacher(
            self.passes,
            model_cfg,
            algo_cfg,
            use_te=use_te,
            initial_policy=lambda: self.reference if self.reference is not None else initial(),
            fresh_policy=initial,
        )

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        return [m.module for m in self.model]

    @property
    def vocab_size(self) -> int:
        """The policy's true vocabulary (ids at and above it are the padded rows of the sharded logits)."""
        return self.passes.vocab_size

    # --- scoring: the statistics the update reads ----------------------------------------------------------------
    def score(self, rollouts: Rollouts, items: Sequence[PromptItem], *, mini_batches: int) -> Statistics:
        """The `Statistics` of ``rollouts``: the behaviour log-probs (unless the update takes its own:
        `needs_statistics_pass`), the reference's (a KL reference: algo.kl.coef > 0, or PBA's anchor) and the
        teacher's scores (algo.distill.kind), each of the update's ``mini_batches`` planned as the update plans it (so
        the first mini-batch's are exactly what its forward computes from the same weights). Under routing replay's
        ``train`` the statistics pass records the routing that every later pass, the update's too, replays."""
        old_logp, routed, scored = None, None, rollouts
        if self.needs_statistics_pass(mini_batches):
            policy = self.statistics_pass(rollouts, mini_batches)
            old_logp, routed = policy.old_logp, policy.routed_experts
            if routed is not None:
                scored = dataclasses.replace(rollouts, routed_experts=routed)
        ref_logp = self.compute_ref_logp(scored, mini_batches) if self.has_reference else None
        teacher, groups = self.teacher.scores(rollouts, items, mini_batches) if self.teacher else (None, None)
        return Statistics(
            old_logp=old_logp, ref_logp=ref_logp, teacher=teacher, context_groups=groups, routed_experts=routed
        )

    def statistics_pass(self, sequences: Sequences, mini_batches: int = 1) -> Statistics:
        """The policy's statistics pass alone: the behaviour log-probs of all ``sequences`` [B, S - 1], on every
        rank, and the routing it recorded (routing replay's ``train``; else None), planned per mini-batch of an
        update of ``mini_batches``."""
        top_n = self.algo_cfg.loss.top_n
        logp, routed = self.passes.per_token(sequences, "logp", self.model, "statistics", top_n, mini_batches)
        return Statistics(old_logp=logp, routed_experts=routed)

    def compute_old_logp(self, sequences: Sequences, mini_batches: int = 1) -> torch.Tensor:
        """The behaviour log-probs of `statistics_pass`."""
        return self.statistics_pass(sequences, mini_batches).old_logp

    def compute_ref_logp(self, sequences: Sequences, mini_batches: int = 1) -> torch.Tensor:
        """The frozen reference's log-probs of all ``sequences`` [B, S - 1], on every rank (needs a reference model:
        algo.kl.coef > 0, or algo.kl.pba.enabled with algo.kl.pba.coef > 0; planned per mini-batch of an update of
        ``mini_batches``)."""
        if not self.has_reference:
            raise RuntimeError(
                "compute_ref_logp: the actor has no reference model (algo.kl.coef = 0 and no PBA "
                "anchor: algo.kl.pba.enabled false or algo.kl.pba.coef = 0)"
            )
        top_n = self.algo_cfg.loss.top_n
        if self.lora is not None:  # the base: the policy's chunks with every adapter off
            with self.lora.base():
                return self.passes.per_token(sequences, "logp", self.model, "other", top_n, mini_batches)[0]
        return self.passes.per_token(sequences, "logp", self.reference, "other", top_n, mini_batches)[0]

    @property
    def resets_reference(self) -> bool:
        """ARMOR's reference: a frozen copy that ``reset_reference`` sets to the policy (saved in checkpoints)."""
        return self.reference is not None and self.algo_cfg.mixes_ratio

    @property
    def has_reference(self) -> bool:
        """Whether the loss reads a KL reference: a frozen copy, or under LoRA the base with the adapters off."""
        return self.reference is not None or (self.lora is not None and self.algo_cfg.needs_reference)

    def compute_entropy(self, sequences: Sequences) -> torch.Tensor:
        """The policy's entropy at every position of all ``sequences`` [B, S - 1], on every rank (0 past a
        sequence's last response token when packed). Any batch size: the first sequence is repeated, masked out,
        until every DP rank gets whole micro-batches (pipeline stages exchange fixed-shape activations)."""
        from megatron.core import parallel_state as ps

        n = len(sequences)
        extra = -n % (ps.get_data_parallel_world_size() * self.cfg.micro_batch_size)
        if extra:
            padded = sequences.select(torch.cat([torch.arange(n), torch.zeros(extra, dtype=torch.long)]))
            keep = (torch.arange(n + extra) < n)[:, None]
            sequences = dataclasses.replace(padded, response_mask=padded.response_mask & keep)
        return self.passes.per_token(sequences, "entropy", self.model, "other", self.algo_cfg.loss.top_n)[0][:n]

    def needs_statistics_pass(self, mini_batches: int) -> bool:
        """Whether the update needs old log-probs from a statistics pass first. Not when it is exactly on-policy:
        one mini-batch per step (the weights the update starts from are those that would compute them) and no
        reference model; then ``update`` takes the log-probs of its own forward, detached, as the old ones."""
        return mini_batches > 1 or self.has_reference

    # --- the update ---------------------------------------------------------------------------------------------
    def update(
        self, rollouts: Rollouts, targets: Targets, statistics: Statistics, *, mini_batches: int
    ) -> dict[str, float]:
        """One optimizer step per mini-batch over the rollouts; returns averaged loss metrics (on every rank) and
        ``rollout/logp_mismatch``, the train/inference mismatch of the behaviour log-probs.

        ``statistics.old_logp is None`` (see ``needs_statistics_pass``): the old log-probs are the update's own,
        detached (the mismatch then reads those)."""
        from megatron.core import parallel_state as ps

        callbacks.fire("actor.before_update", actor=self)
        batch = TrainingRows.join(rollouts, targets, statistics)
        own_old = batch.old_logp is None
        if own_old and mini_batches != 1:
            raise ValueError(
                f"update: statistics.old_logp is None with {mini_batches} mini-batches; only a single mini-batch is "
                "on-policy (see needs_statistics_pass): score first"
            )
        for m in self.model:
            m.train()
        dp = ps.get_data_parallel_world_size()
        device = distributed.device()
        totals: dict[str, list[float]] = {}
        behaviour_logp = batch.old_logp
        for rows in mini_batch_rows(len(batch), mini_batches):  # the split `score` planned by
            mini = batch.select(rows)
            contrast: dict[str, float] = {}
            if (
                self.algo_cfg.distill.kind == "crpo" and self.algo_cfg.distill.crpo.coef > 0
            ):  # mini-batches hold whole groups
                planned = self.passes.plan(mini)
                with self.replay.pass_over(mini, planned[0], "other"):
                    weights, contrast = contrast_weights(self.passes, self.model, mini, planned, self.algo_cfg)
                mini = dataclasses.replace(mini, crpo_weights=weights)
            plan, micro = self.passes.plan(mini)
            scale = len(micro) * dp  # undo the schedule's 1/num_microbatches and DDP's 1/dp
            num_tokens = float(mini.response_mask.sum())
            num_seqs = float((mini.response_mask.sum(-1) > 0).sum())
            logp_rows: list[torch.Tensor] = []

            def loss_fn(mb: MicroBatch, logits: torch.Tensor):
                seqs = mb.seqs.to(device)
                if not isinstance(seqs, TrainingRows):
                    raise TypeError("update: a micro-batch without its training rows")
                student_at = None
                if seqs.teacher is not None:  # distillation: the student's logits at the teacher's top-N ids
                    logits, student_at = student_logits_at(self.passes, logits, mb, seqs.teacher.topn_ids)
                # nothing reads the logits after the loss: the op's backward may overwrite them with their gradient
                stats = self.passes.token_stats(logits, mb, self.algo_cfg.loss.top_n, inplace_backward=True)
                self.replay.note_logp(mb, stats.logp)
                old_logp = seqs.old_logp
                if own_old:
                    old_logp = stats.logp.detach()
                    logp_rows.append(old_logp)
                loss, metrics = policy_loss(
                    stats,
                    old_logp,
                    seqs.advantages,
                    seqs.response_mask,
                    self.algo_cfg,
                    ref_logp=seqs.ref_logp,
                    rollout_logp=seqs.engine_logp,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    target_ids=seqs.tokens[:, 1:],
                    kl_coef=seqs.kl_coef,
                    teacher=seqs.teacher,
                    student_at_teacher_ids=student_at,
                    crpo_weights=seqs.crpo_weights,
                    mixed_ratio_share=self.mixed_ratio_share,
                )
                return loss * scale, {k: torch.tensor(float(v)) for k, v in metrics.items()} | {
                    "loss": loss.detach().clone()
                }

            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            with self.replay.pass_over(mini, plan, "update", rescore=self._rescore):  # then: log-probs, no replay
                outputs = self.passes.run(micro, loss_fn, forward_only=False, model=self.model)
            if own_old:  # the whole batch (one mini-batch), every rank
                behaviour_logp = self.passes.gather(logp_rows, plan, len(mini), mini.response_mask.shape[1])
            if self._all_finite(outputs):
                ok, grad_norm, _ = self.optimizer.step()
            else:  # a non-finite loss or gradient anywhere: every rank skips this step (the trainer counts them)
                ok, grad_norm = False, math.nan
            if ok:
                self.scheduler.step(increment=1)
                if self.teacher is not None:  # CRPO's EMA teacher follows the updated policy (else nothing)
                    self.teacher.follow(self.model_chunks)
            step_metrics = {
                "actor/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "actor/nonfinite": float(not ok),
                "actor/lr": self.optimizer.param_groups[0]["lr"],
            } | contrast
            if self.cfg.cp > 1:  # the share of stream tokens that CP's per-sequence padding adds (the mini-batch)
                step_metrics["actor/cp_padding"] = self.passes.last_cp_padding
            if outputs:
                step_metrics["actor/loss"] = sum(float(o.pop("loss")) for o in outputs)
                step_metrics |= combine_micro_batches([{k: float(v) for k, v in o.items()} for o in outputs])
            for key, value in step_metrics.items():
                totals.setdefault(key, []).append(value)
        metrics = {k: sum(v) / len(v) for k, v in totals.items()}
        metrics = finish_subset_means(across_data_parallel(metrics, summed=summed_over_data_parallel()))
        mismatch = logp_mismatch(rollouts.engine_logp, behaviour_logp, rollouts.response_mask)
        return from_last_stage(metrics) | self.replay.metrics() | {"rollout/logp_mismatch": mismatch}

    def _rescore(self, micro: list[MicroBatch]) -> list[torch.Tensor]:
        """The policy's log-probs of ``micro``, forward only (routing replay's comparison; last stage, else [])."""

        def collect(mb: MicroBatch, logits: torch.Tensor):
            return torch.zeros(()), {"logp": self.passes.token_stats(logits, mb, self.algo_cfg.loss.top_n).logp.float()}

        return [o["logp"] for o in self.passes.run(micro, collect, forward_only=True, model=self.model)]

    def _all_finite(self, outputs: list[dict]) -> bool:
        bad = any(not math.isfinite(float(o["loss"])) for o in outputs)
        for m in self.model:
            for p in m.module.parameters():
                grad = getattr(p, "main_grad", None)
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    bad = True
                    break
        flag = torch.tensor([int(bad)])
        dist.all_reduce(flag)
        return int(flag) == 0

    # --- weights out, state in and out --------------------------------------------------------------------------
    def export_weights(
        self, bucket_bytes: int, include_lm_head: bool = True, lend: bool = False
    ) -> Iterator[WeightBucket]:
        """The bridge's HF-layout buckets (``lend``: views valid until the next bucket; see export_hf_weights); under
        LoRA the adapted weights merged, W + (alpha / r) B A."""
        from megatron_rlvr.bridge import export_hf_weights

        scale = self.lora.scale if self.lora is not None else None
        return export_hf_weights(
            self.model_chunks,
            self.hf,
            bucket_bytes=bucket_bytes,
            include_lm_head=include_lm_head,
            lend=lend,
            lora_scale=scale,
        )

    def engine_weights(self, bucket_bytes: int, lend: bool = False) -> Iterator[WeightBucket]:
        """What the engines load after an update: ``export_weights``, or under ``actor.lora.sync: adapters`` the
        adapter alone in PEFT's names (bridge/peft.py)."""
        if self.lora is not None and self.lora.cfg.sync == "adapters":
            return self.export_adapter(bucket_bytes)
        return self.export_weights(bucket_bytes, lend=lend)

    def adapter_config(self) -> dict[str, Any] | None:
        """PEFT's adapter_config.json of the LoRA adapter (None: full fine-tuning)."""
        return self.lora.adapter_config(self.hf) if self.lora is not None else None

    def export_adapter(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The LoRA adapter alone in PEFT's names and layout (bridge/adapter_export.py)."""
        if self.lora is None:
            raise RuntimeError("export_adapter: the actor has no LoRA adapter (actor.lora is null)")
        return self.lora.export_adapter(self.model_chunks, self.hf, bucket_bytes)

    def reset_reference(self) -> None:
        """ARMOR: the frozen reference takes the policy's current weights (docs/algorithms.md, "ARMOR"). Both are
        this rank's chunks at one layout, so the copy is local: no communication."""
        if self.reference is None or self.lora is not None:
            raise RuntimeError(
                "reset_reference: the actor has no resettable reference (ARMOR needs algo.armor.mixed_ratio_share)"
            )
        with torch.no_grad():
            for ref, policy in zip(self.reference, self.model_chunks):
                ref.load_state_dict(policy.state_dict())

    def sharded_state_dict(self, metadata: Mapping[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """The chunks' and the optimizer's sharded state (one ``model`` key, or ``model{i}`` per virtual stage; under
        LoRA the adapters alone and the base they need: actor/lora.py); under ARMOR also the reference's chunks
        (``reference{i}``), which a reset made differ from the initial weights."""
        chunks = self.model_chunks
        if self.lora is not None:
            state = self.lora.sharded_state()
        elif len(chunks) == 1:
            state: dict[str, Any] = {"model": chunks[0].sharded_state_dict()}
        else:
            state = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
        if is_loading:
            prepare_for_load(self.optimizer)
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=dict(metadata))
        if self.resets_reference:  # after the optimizer's request: its parameter map covers the policy alone
            for i, chunk in enumerate(self.reference):
                state[f"reference{i}"] = chunk.sharded_state_dict(prefix=f"reference{i}.")
        if self.teacher is not None:  # CRPO's EMA teacher is state (a frozen one is rebuilt from the initial weights)
            state |= self.teacher.sharded_state()
        return state

    def load_sharded_state_dict(self, loaded: Mapping[str, Any]) -> None:
        chunks = self.model_chunks
        if self.lora is not None:
            self.lora.load_sharded_state(loaded)
        for i, chunk in enumerate(chunks if self.lora is None else []):
            chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
        if self.resets_reference:
            for i, chunk in enumerate(self.reference):
                chunk.load_state_dict(_unprefixed(loaded[f"reference{i}"], f"reference{i}."))
        with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
            self.optimizer.load_state_dict(loaded["optimizer"])
        restore_torch_adam_steps(self.optimizer)
        if self.teacher is not None:
            self.teacher.load_state(loaded)

    def scheduler_state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_scheduler_state_dict(self, state: Mapping[str, Any]) -> None:
        load_schedule(self.scheduler, dict(state))


def _unprefixed(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
