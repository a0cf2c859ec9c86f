"""MegatronActor: a megatron-core policy (any TP/PP/VPP/CP/EP) with its optimizer; a no-grad statistics pass over
rollouts and an update pass over micro-batches through megatron-core's pipeline schedule.

The actor sees rollouts as `SequenceBatch` (prompt + response token ids, right-padded, a mask of the response
positions, per-sequence advantages). Every loss reads only the fused op's per-token statistics, computed on the
last pipeline stage from the vocab-sharded logits. Loss scaling: `policy_loss` normalizes by the global token /
sequence counts of the whole mini-batch, and the schedule's `/ num_microbatches` and DDP's `/ dp` are undone here, so
the gradient is exactly that of the mini-batch loss whatever the micro-batching and data parallelism.

Every pass plans the mini-batch the same way (packing.py): sequences split over DP ranks with about equal token
counts, micro-batches of ``micro_batch_size`` sequences or under ``max_tokens_per_micro_batch`` real tokens, the same
micro-batch count on every DP rank. With ``pack_sequences`` (the default) a micro-batch runs as one THD stream
(``PackedSeqParams``: TE's attention on GPU, runtime/cpu/attention.py without TE), the fused op sees only the stream's tokens,
and its per-token outputs are put back into the right-padded [b, S - 1] view the losses read; so no loss knows
whether a batch was packed, and packing changes no number beyond float rounding.
With ``actor.cp > 1`` (docs/context-parallel.md) each CP rank runs its share of every sequence (packing.py's split),
the op's per-token outputs are gathered over CP (actor/context_parallel.py), and every CP rank computes the identical
whole micro-batch loss; its gradient share is summed over DP x CP by megatron's DDP.

With ``algo.kl_coef > 0`` (or PBA with ``algo.pba_kl_coef > 0``) the actor also holds a frozen reference policy (the
same chunks, loaded from the same initial weights, never trained) whose log-probs feed the loss's k3 KL term; without
it nothing extra is built. ``SequenceBatch.kl_coef`` (PBA) gives that term's coefficient per sequence.
With ``algo.distill`` the actor also holds a frozen teacher (actor/teacher.py), scored beside the reference; its scores
travel in ``SequenceBatch.teacher_*`` into the loss's distillation terms.
With ``actor.router_replay`` (MoE models, docs/routing-replay.md) every forward routes each token to the experts its
statistics pass recorded or its engine chose (actor/router_replay.py), carried in ``SequenceBatch.routed_experts``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_rlvr.actor.batch import SequenceBatch
from megatron_rlvr.actor.config import ActorConfig
from megatron_rlvr.actor.context_parallel import packed_seq_params, padding_fraction, stream_to_view
from megatron_rlvr.actor.gathering import across_data_parallel, from_last_stage, to_every_rank
from megatron_rlvr.actor.packing import (
    PackedLayout,
    Plan,
    cp_padded_length,
    pack,
    plan_micro_batches,
    sequence_lengths,
    stream_tokens,
)
from megatron_rlvr.actor.router_replay import RouterReplayer
from megatron_rlvr.actor.teacher import build_teacher, student_logits_at
from megatron_rlvr.algos import policy_loss
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.distill import TeacherScores
from megatron_rlvr.algos.metrics import combine_micro_batches, finish_subset_means, summed_over_data_parallel
from megatron_rlvr.models.config import ModelConfig
from megatron_rlvr.ops import TokenStats, vocab_parallel_token_stats
from megatron_rlvr.runtime import distributed

MONITOR_TOP_N = 3  # rank-1/2/3 probabilities are always reported, whatever the loss's top_n


@dataclass
class _MicroBatch:
    """One micro-batch of this rank: its rows of the mini-batch (the padded view the losses read) and, when packed,
    the THD stream the model runs on."""

    seqs: SequenceBatch
    packed: PackedLayout | None


class MegatronActor:
    def __init__(
        self,
        model_cfg: ModelConfig,
        actor_cfg: ActorConfig,
        algo_cfg: AlgoConfig,
        *,
        temperature: float,
        total_steps: int,
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        from megatron_rlvr.models import load_hf_config, padded_vocab_size, transformer_config_from_hf

        self.cfg, self.algo_cfg, self.temperature = actor_cfg, algo_cfg, temperature
        self.last_cp_padding = 0.0  # the last planned mini-batch's CP padding share (actor/cp_padding)
        if actor_cfg.cp > 1 and not actor_cfg.pack_sequences:
            raise ValueError("actor.cp > 1 needs actor.pack_sequences=true (the CP split is of packed streams)")
        self.hf = load_hf_config(model_cfg.hf_dir)
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
            # padded to one length instead (`_plan`).
            variable_seq_lengths=actor_cfg.pp > 1 and not actor_cfg.vpp,
        )
        # the schedules call it after the last backward: DP grad reduce(-scatter) and tied-embedding sync over PP
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.replay = RouterReplayer(actor_cfg.router_replay, self.tcfg)  # before any router is built
        chunks = self._build_chunks(model_cfg)
        # The KL term's frozen reference: bare chunks (no DDP, no optimizer, no grad) in eval mode. Checkpoints do
        # not hold it: a resumed run rebuilds it from the same initial weights, which is the reference it had.
        self.reference: list[torch.nn.Module] | None = None
        if needs_reference(algo_cfg):
            self.reference = self._build_chunks(model_cfg)
            for c in self.reference:
                c.requires_grad_(False)
                c.eval()
        self.replay.install(chunks, self.reference)  # actor.router_replay hooks on both models' routers
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=actor_cfg.use_distributed_optimizer,
            overlap_grad_reduce=False,
        )
        self.model = [DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=c) for c in chunks]
        self.optimizer, self.scheduler = self._build_optimizer(total_steps)
        self.vocab_size = int(self.hf["vocab_size"])
        self.local_vocab = (
            padded_vocab_size(self.vocab_size, actor_cfg.tp, model_cfg.make_vocab_size_divisible_by) // actor_cfg.tp
        )
        # algo.distill: a frozen teacher beside the reference (actor/teacher.py); trainer: actor.teacher.attach(...)
        self.teacher = build_teacher(self, model_cfg, algo_cfg)

    # -----------------------------------------------------------------------------------------------------------
    def _build_chunks(self, model_cfg: ModelConfig) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks (one per virtual pipeline stage) with the initial weights: the dist checkpoint
        ``model.load`` if given, else the HF weights of ``model.hf_dir``. Builds the policy and the reference alike."""
        from megatron.core import parallel_state as ps

        from megatron_rlvr.bridge import load_hf_weights
        from megatron_rlvr.models import build_gpt_model
        from megatron_rlvr.models.builder import resolve_use_te

        use_te = resolve_use_te(model_cfg.use_transformer_engine)
        chunks = []
        for vp in range(self.cfg.vpp or 1):
            vp_stage = vp if self.cfg.vpp else None
            chunks.append(
                build_gpt_model(
                    self.hf,
                    self.tcfg,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    vp_stage=vp_stage,
                    use_te=use_te,
                    make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
                )
            )
        if model_cfg.load:
            from megatron_rlvr.bridge.dist_ckpt import load_dist_checkpoint

            load_dist_checkpoint(chunks, self.hf["vocab_size"], model_cfg.load)
        else:
            load_hf_weights(chunks, model_cfg.hf_dir)
        return chunks

    def _build_optimizer(self, total_steps: int):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self.cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=a.lr,
            min_lr=a.min_lr,
            weight_decay=a.weight_decay,
            adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2,
            adam_eps=a.adam_eps,
            clip_grad=a.grad_clip,
            bf16=a.bf16,
            params_dtype=torch.float32,
            use_distributed_optimizer=a.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_cfg, self.model)
        steps = max(1, total_steps)
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if a.lr_warmup_steps else a.lr,
            max_lr=a.lr,
            min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_steps,
            lr_decay_steps=steps,
            lr_decay_style=a.lr_decay_style,
            start_wd=a.weight_decay,
            end_wd=a.weight_decay,
            wd_incr_steps=steps,
            wd_incr_style="constant",
        )
        return optimizer, scheduler

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        return [m.module for m in self.model]

    def _plan(self, batch: SequenceBatch) -> tuple[Plan, list[_MicroBatch]]:
        """The mini-batch's plan over all DP ranks (the same on every rank) and this rank's micro-batches."""
        from megatron.core import parallel_state as ps

        lengths = sequence_lengths(batch.response_mask)
        cp = self.cfg.cp
        # budgets and the DP balance count the tokens each CP rank holds: 1 / cp of each (padded) sequence
        per_rank = [cp_padded_length(n, cp) // cp for n in lengths]
        plan = plan_micro_batches(
            per_rank,
            ps.get_data_parallel_world_size(),
            micro_batch_size=self.cfg.micro_batch_size,
            max_tokens=self.cfg.max_tokens_per_micro_batch,
            count_multiple=self.cfg.pp if self.cfg.vpp else 1,
        )
        # sequence parallelism splits the stream's tokens over the TP ranks: a multiple of tp
        multiple = self.cfg.tp if self.cfg.sequence_parallel else 1
        mine = plan[ps.get_data_parallel_rank()]
        total = None  # the stream's own length, rounded up to the multiple
        if self.cfg.vpp:  # one shape for every micro-batch (see variable_seq_lengths); the same on every PP stage
            total = max(stream_tokens([lengths[i] for i in rows], multiple, cp) for rows in mine)
        cp_rank = ps.get_context_parallel_rank() if cp > 1 else 0
        micro = []
        for rows in mine:
            seqs = batch.select(torch.tensor(rows))
            packed = None
            if self.cfg.pack_sequences:
                packed = pack(seqs.tokens, [lengths[i] for i in rows], multiple, total, cp=cp, cp_rank=cp_rank)
            micro.append(_MicroBatch(seqs, packed))
        self.last_cp_padding = padding_fraction(lengths, cp)
        return plan, micro

    def _token_stats(self, logits: torch.Tensor, mb: _MicroBatch, inplace_backward: bool = False) -> TokenStats:
        """Statistics at positions 0..S-2 of the padded view (position t predicts token t + 1). The op runs on the
        whole contiguous logits (the padded block, or the packed stream) with each position's target beside it (a
        dummy at the last position of a sequence), so no [T, V/tp] copy is made and the backward may write the
        gradient into the logits buffer itself. Packed: the stream's outputs are placed into the padded view."""
        from megatron.core import parallel_state as ps

        if mb.packed is None:
            targets = torch.roll(mb.seqs.tokens, shifts=-1, dims=1)
        else:
            targets = mb.packed.targets
        stats = vocab_parallel_token_stats(
            logits,
            targets.to(logits.device),
            max(self.algo_cfg.top_n, MONITOR_TOP_N),
            group=ps.get_tensor_model_parallel_group() if self.cfg.tp > 1 else None,
            vocab_start=ps.get_tensor_model_parallel_rank() * self.local_vocab,
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            chunk_tokens=self.cfg.stats_chunk_tokens,
            inplace_backward=inplace_backward,
        )
        if mb.packed is None:
            return TokenStats(*(t[:, :-1] for t in stats))
        shape = tuple(mb.seqs.response_mask.shape)
        return TokenStats(*(stream_to_view(t[0], mb.packed, shape) for t in stats))

    def _forward(self, model: torch.nn.Module, mb: _MicroBatch) -> torch.Tensor:
        device = distributed.device()
        if mb.packed is not None:
            p = mb.packed
            params = packed_seq_params(p, device)
            return model(p.tokens.to(device), p.position_ids.to(device), attention_mask=None, packed_seq_params=params)
        tokens = mb.seqs.tokens.to(device)
        b, s = tokens.shape
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
        return model(tokens, position_ids, attention_mask=causal)

    def _run_schedule(
        self, micro_batches: list[_MicroBatch], loss_fn, forward_only: bool, model: list[torch.nn.Module]
    ) -> list[dict]:
        """Megatron's pipeline schedule over ``model``'s chunks: the DDP-wrapped policy, or the bare reference
        (forward only). Micro-batches differ in shape; under PP the stages exchange each one's shape first
        (``variable_seq_lengths``), so the schedule's seq_length / micro_batch_size (the first one's) are nominal."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[_MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            return self.replay.forward(model, mb, self._forward), partial(loss_fn, mb)  # replay follows mb's tokens

        first = micro_batches[0]
        # the whole stream's length: the schedule divides it by cp (and by tp under sequence parallelism) itself
        seq_length, micro_batch_size = (first.packed.stream_total, 1) if first.packed else first.seqs.tokens.shape[::-1]
        data = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def _to_every_rank(self, rows: list[torch.Tensor], plan: Plan, size: int, width: int) -> torch.Tensor:
        """Per-sequence rows of this rank's micro-batches -> the whole mini-batch on every rank (gathering.py)."""
        return to_every_rank(rows, plan, size, width)

    # -----------------------------------------------------------------------------------------------------------
    def compute_old_logp(self, batch: SequenceBatch) -> torch.Tensor:
        """The behaviour log-probs of the whole batch [B, S - 1], on every rank."""
        return self._per_token(batch, "logp", self.model)

    def compute_ref_logp(self, batch: SequenceBatch) -> torch.Tensor:
        """The frozen reference's log-probs of the whole batch [B, S - 1], on every rank (needs a reference model:
        algo.kl_coef > 0, or algo.pba with algo.pba_kl_coef > 0)."""
        if self.reference is None:
            raise RuntimeError(
                "compute_ref_logp: the actor has no reference model (algo.kl_coef = 0 and no PBA "
                "anchor: algo.pba false or algo.pba_kl_coef = 0)"
            )
        return self._per_token(batch, "logp", self.reference)

    def compute_entropy(self, batch: SequenceBatch) -> torch.Tensor:
        """The policy's entropy at every position of the whole batch [B, S - 1], on every rank (0 past a
        sequence's last response token when packed)."""
        return self._per_token(batch, "entropy", self.model)

    def needs_statistics_pass(self, mini_batches: int) -> bool:
        """Whether the update needs old log-probs from a statistics pass first. Not when it is exactly on-policy:
        one mini-batch per step (the weights the update starts from are those that would compute them) and no
        reference model; then ``update`` takes the log-probs of its own forward, detached, as the old ones."""
        return mini_batches > 1 or self.reference is not None

    @torch.no_grad()
    def _per_token(self, batch: SequenceBatch, field: str, model: list[torch.nn.Module]) -> torch.Tensor:
        """One per-token statistic of the fused op over the whole batch, run through ``model``'s chunks (the policy
        or the reference), no grad, gathered to every rank. Positions past a sequence's last response token are
        padding: 0 when packed (nothing computes them), whatever the padded block gives otherwise."""
        for m in model:
            m.eval()
        plan, micro = self._plan(batch)

        def collect(mb: _MicroBatch, logits: torch.Tensor):
            return torch.zeros(()), {field: getattr(self._token_stats(logits, mb), field).float()}

        with self.replay.pass_over(batch, plan, "statistics" if field == "logp" and model is self.model else "other"):
            outputs = self._run_schedule(micro, collect, forward_only=True, model=model)
        return self._to_every_rank([o[field] for o in outputs], plan, len(batch), batch.response_mask.shape[1])

    def update(self, batch: SequenceBatch, mini_batches: int) -> dict[str, float]:
        """One optimizer step per mini-batch over the rollouts; returns averaged loss metrics (on every rank).

        ``batch.old_logp is None`` (see ``needs_statistics_pass``): the old log-probs are the update's own, detached,
        and ``batch.old_logp`` is filled with them (the whole batch, every rank) for the caller's logs."""
        from megatron.core import parallel_state as ps

        own_old = batch.old_logp is None
        if own_old and mini_batches != 1:
            raise ValueError(
                f"update: batch.old_logp is None with {mini_batches} mini-batches; only a single mini-batch is "
                "on-policy (see needs_statistics_pass): run compute_old_logp first"
            )
        for m in self.model:
            m.train()
        dp = ps.get_data_parallel_world_size()
        device = distributed.device()
        per_mini = len(batch) // mini_batches
        totals: dict[str, list[float]] = {}
        for i in range(mini_batches):
            mini = batch.select(slice(i * per_mini, (i + 1) * per_mini))
            plan, micro = self._plan(mini)
            scale = len(micro) * dp  # undo the schedule's 1/num_microbatches and DDP's 1/dp
            num_tokens = float(mini.response_mask.sum())
            num_seqs = float((mini.response_mask.sum(-1) > 0).sum())
            logp_rows: list[torch.Tensor] = []

            def loss_fn(mb: _MicroBatch, logits: torch.Tensor):
                seqs = mb.seqs.to(device)
                teacher, student_at = None, None
                if seqs.teacher_logp is not None:  # distillation: the student's logits at the teacher's top-N ids
                    teacher = TeacherScores(seqs.teacher_logp, seqs.teacher_ids, seqs.teacher_logits)
                    logits, student_at = student_logits_at(self, logits, mb, seqs.teacher_ids)
                # nothing reads the logits after the loss: the op's backward may overwrite them with their gradient
                stats = self._token_stats(logits, mb, inplace_backward=True)
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
                    rollout_logp=seqs.rollout_logp,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    target_ids=seqs.tokens[:, 1:],
                    kl_coef=seqs.kl_coef,
                    teacher=teacher,
                    student_at_teacher_ids=student_at,
                )
                return loss * scale, {k: torch.tensor(float(v)) for k, v in metrics.items()} | {
                    "loss": loss.detach().clone()
                }

            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            with self.replay.pass_over(mini, plan, "update", actor=self):  # then: the log-probs without replay
                outputs = self._run_schedule(micro, loss_fn, forward_only=False, model=self.model)
            if own_old:
                batch.old_logp = self._to_every_rank(logp_rows, plan, len(mini), mini.response_mask.shape[1])
            if self._all_finite(outputs):
                ok, grad_norm, _ = self.optimizer.step()
            else:  # a non-finite loss or gradient anywhere: every rank skips this step (the trainer counts them)
                ok, grad_norm = False, math.nan
            if ok:
                self.scheduler.step(increment=1)
            step_metrics = {
                "actor/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "actor/nonfinite": float(not ok),
                "actor/lr": self.optimizer.param_groups[0]["lr"],
            }
            if self.cfg.cp > 1:  # the share of stream tokens that CP's per-sequence padding adds (the mini-batch)
                step_metrics["actor/cp_padding"] = self.last_cp_padding
            if outputs:
                step_metrics["actor/loss"] = sum(float(o.pop("loss")) for o in outputs)
                step_metrics |= combine_micro_batches([{k: float(v) for k, v in o.items()} for o in outputs])
            for key, value in step_metrics.items():
                totals.setdefault(key, []).append(value)
        metrics = {k: sum(v) / len(v) for k, v in totals.items()}
        metrics = finish_subset_means(across_data_parallel(metrics, summed=summed_over_data_parallel()))
        return from_last_stage(metrics) | self.replay.metrics()

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

    def export_weights(
        self, bucket_bytes: int, include_lm_head: bool = True, lend: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The bridge's HF-layout buckets (``lend``: views valid until the next bucket; see export_hf_weights)."""
        from megatron_rlvr.bridge import export_hf_weights

        return export_hf_weights(
            self.model_chunks, self.hf, bucket_bytes=bucket_bytes, include_lm_head=include_lm_head, lend=lend
        )


def needs_reference(cfg: AlgoConfig) -> bool:
    """Whether the loss has a KL-to-reference term: a global coefficient, or PBA's anchor on risky prompts."""
    return cfg.kl_coef > 0 or (cfg.pba and cfg.pba_kl_coef > 0)
