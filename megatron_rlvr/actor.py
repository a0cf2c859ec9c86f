"""MegatronActor: a megatron-core policy (any TP/PP/VPP) with its optimizer; a no-grad statistics pass over rollouts
and an update pass over micro-batches through megatron-core's pipeline schedule.

The actor sees rollouts as `SequenceBatch` (prompt + response token ids, right-padded, a mask of the response
positions, per-sequence advantages). Every loss reads only the fused op's per-token statistics, computed on the
last pipeline stage from the vocab-sharded logits. Loss scaling: `policy_loss` normalizes by the global token /
sequence counts of the whole mini-batch, and the schedule's `/ num_microbatches` and DDP's `/ dp` are undone here, so
the gradient is exactly that of the mini-batch loss whatever the micro-batching and data parallelism.

With ``algo.kl_coef > 0`` the actor also holds a frozen reference policy (the same chunks, loaded from the same
initial weights, never trained) whose log-probs feed the loss's k3 KL term; without it nothing extra is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_rlvr.algos import policy_loss
from megatron_rlvr.algos.config import AlgoConfig
from megatron_rlvr.algos.losses import LOSS_TERMS
from megatron_rlvr.config import ActorConfig, ModelConfig
from megatron_rlvr.monitor.dynamics import token_weighted_mean
from megatron_rlvr.ops import TokenStats, vocab_parallel_token_stats

MONITOR_TOP_N = 3  # rank-1/2/3 probabilities are always reported, whatever the loss's top_n


@dataclass
class SequenceBatch:
    """Rollouts as the actor trains on them; position t of the statistics predicts token t + 1."""

    tokens: torch.Tensor  # [B, S] int64, prompt + response, right-padded
    response_mask: torch.Tensor  # [B, S - 1] bool: target position t+1 is a response token
    advantages: torch.Tensor  # [B] float32
    old_logp: torch.Tensor | None = None  # [B, S - 1] from the statistics pass
    ref_logp: torch.Tensor | None = None  # [B, S - 1] of the frozen reference, when algo.kl_coef > 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: torch.Tensor | slice) -> "SequenceBatch":
        return SequenceBatch(
            self.tokens[index], self.response_mask[index], self.advantages[index],
            None if self.old_logp is None else self.old_logp[index],
            None if self.ref_logp is None else self.ref_logp[index],
        )


class MegatronActor:
    def __init__(
        self, model_cfg: ModelConfig, actor_cfg: ActorConfig, algo_cfg: AlgoConfig, *, temperature: float,
        total_steps: int,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        from megatron_rlvr.models import load_hf_config, padded_vocab_size, transformer_config_from_hf

        self.cfg, self.algo_cfg, self.temperature = actor_cfg, algo_cfg, temperature
        self.hf = load_hf_config(model_cfg.hf_dir)
        dtype = torch.bfloat16 if actor_cfg.bf16 else torch.float32
        self.tcfg = transformer_config_from_hf(
            self.hf, tp=actor_cfg.tp, pp=actor_cfg.pp, vpp=actor_cfg.vpp, params_dtype=dtype,
            sequence_parallel=actor_cfg.sequence_parallel, recompute=actor_cfg.recompute,
        )
        # the schedules call it after the last backward: DP grad reduce(-scatter) and tied-embedding sync over PP
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        chunks = self._build_chunks(model_cfg)
        # The KL term's frozen reference: bare chunks (no DDP, no optimizer, no grad) in eval mode. Checkpoints do
        # not hold it: a resumed run rebuilds it from the same initial weights, which is the reference it had.
        self.reference: list[torch.nn.Module] | None = None
        if algo_cfg.kl_coef > 0:
            self.reference = self._build_chunks(model_cfg)
            for c in self.reference:
                c.requires_grad_(False)
                c.eval()
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=actor_cfg.use_distributed_optimizer,
            overlap_grad_reduce=False,
        )
        self.model = [DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=c) for c in chunks]
        self.optimizer, self.scheduler = self._build_optimizer(total_steps)
        self.vocab_size = int(self.hf["vocab_size"])
        self.local_vocab = padded_vocab_size(
            self.vocab_size, actor_cfg.tp, model_cfg.make_vocab_size_divisible_by
        ) // actor_cfg.tp

    # -----------------------------------------------------------------------------------------------------------
    def _build_chunks(self, model_cfg: ModelConfig) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks (one per virtual pipeline stage) with the initial weights: the dist checkpoint
        ``model.load`` if given, else the HF weights of ``model.hf_dir``. Builds the policy and the reference alike."""
        from megatron.core import parallel_state as ps

        from megatron_rlvr.bridge import load_hf_weights
        from megatron_rlvr.models import build_gpt_model

        chunks = []
        for vp in range(self.cfg.vpp or 1):
            vp_stage = vp if self.cfg.vpp else None
            chunks.append(build_gpt_model(
                self.hf, self.tcfg, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage), vp_stage=vp_stage,
                make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
            ))
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
            optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.grad_clip, bf16=a.bf16, params_dtype=torch.float32,
            use_distributed_optimizer=a.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_cfg, self.model)
        steps = max(1, total_steps)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if a.lr_warmup_steps else a.lr, max_lr=a.lr, min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_steps, lr_decay_steps=steps, lr_decay_style=a.lr_decay_style,
            start_wd=a.weight_decay, end_wd=a.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
        )
        return optimizer, scheduler

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        return [m.module for m in self.model]

    def _dp_slice(self, batch: SequenceBatch) -> SequenceBatch:
        from megatron.core import parallel_state as ps

        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if len(batch) % dp:
            raise ValueError(f"batch of {len(batch)} sequences does not split over data-parallel size {dp}")
        return batch.select(slice(rank, None, dp))

    def _micro_batches(self, batch: SequenceBatch) -> list[SequenceBatch]:
        mbs = self.cfg.micro_batch_size
        return [batch.select(slice(i, i + mbs)) for i in range(0, len(batch), mbs)]

    def _token_stats(self, logits: torch.Tensor, tokens: torch.Tensor, inplace_backward: bool = False) -> TokenStats:
        """Statistics at positions 0..S-2 (position t predicts token t + 1). The op runs on the whole contiguous
        logits with the targets shifted (the last position's target is a dummy), so no [B, S, V/tp] copy is made
        and the backward may write the gradient into the logits buffer itself."""
        from megatron.core import parallel_state as ps

        targets = torch.roll(tokens, shifts=-1, dims=1)
        stats = vocab_parallel_token_stats(
            logits, targets, max(self.algo_cfg.top_n, MONITOR_TOP_N),
            group=ps.get_tensor_model_parallel_group() if self.cfg.tp > 1 else None,
            vocab_start=ps.get_tensor_model_parallel_rank() * self.local_vocab, vocab_size=self.vocab_size,
            temperature=self.temperature, chunk_tokens=self.cfg.stats_chunk_tokens, inplace_backward=inplace_backward,
        )
        return TokenStats(*(t[:, :-1] for t in stats))

    def _forward(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
        return model(tokens, position_ids, attention_mask=causal)

    def _run_schedule(
        self, micro_batches: list[SequenceBatch], loss_fn, forward_only: bool, model: list[torch.nn.Module]
    ) -> list[dict]:
        """Megatron's pipeline schedule over ``model``'s chunks: the DDP-wrapped policy, or the bare reference
        (forward only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[SequenceBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            return self._forward(model, mb.tokens), partial(loss_fn, mb)

        seq_length = micro_batches[0].tokens.shape[1]
        data = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=model if len(model) > 1 else model[0],
            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=self.cfg.micro_batch_size,
            forward_only=forward_only,
        )

    # -----------------------------------------------------------------------------------------------------------
    def compute_old_logp(self, batch: SequenceBatch) -> torch.Tensor:
        """The behaviour log-probs of the whole batch [B, S - 1], on every rank."""
        return self._per_token(batch, "logp", self.model)

    def compute_ref_logp(self, batch: SequenceBatch) -> torch.Tensor:
        """The frozen reference's log-probs of the whole batch [B, S - 1], on every rank (needs algo.kl_coef > 0)."""
        if self.reference is None:
            raise RuntimeError("compute_ref_logp: the actor has no reference model (algo.kl_coef = 0)")
        return self._per_token(batch, "logp", self.reference)

    def compute_entropy(self, batch: SequenceBatch) -> torch.Tensor:
        """The policy's entropy at every position of the whole batch [B, S - 1], on every rank."""
        return self._per_token(batch, "entropy", self.model)

    @torch.no_grad()
    def _per_token(self, batch: SequenceBatch, field: str, model: list[torch.nn.Module]) -> torch.Tensor:
        """One per-token statistic of the fused op over the whole batch, run through ``model``'s chunks (the policy
        or the reference), no grad, gathered to every rank."""
        from megatron.core import parallel_state as ps

        local = self._dp_slice(batch)
        for m in model:
            m.eval()

        def collect(mb: SequenceBatch, logits: torch.Tensor):
            return torch.zeros(()), {field: getattr(self._token_stats(logits, mb.tokens), field).float()}

        outputs = self._run_schedule(self._micro_batches(local), collect, forward_only=True, model=model)
        if outputs:
            values = torch.cat([o[field] for o in outputs])
        else:  # not the last pipeline stage: filled by the broadcast below
            values = torch.empty(local.response_mask.shape, dtype=torch.float32)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
            dist.broadcast(values, src=last, group=group)
        dp = ps.get_data_parallel_world_size()
        if dp > 1:  # _dp_slice takes every dp-th sequence: interleave the slices back
            parts = [torch.empty_like(values) for _ in range(dp)]
            dist.all_gather(parts, values, group=ps.get_data_parallel_group())
            values = torch.stack(parts, dim=1).reshape(len(batch), *values.shape[1:])
        return values

    def update(self, batch: SequenceBatch, mini_batches: int) -> dict[str, float]:
        """One optimizer step per mini-batch over the rollouts; returns averaged loss metrics (on every rank)."""
        from megatron.core import parallel_state as ps

        for m in self.model:
            m.train()
        dp = ps.get_data_parallel_world_size()
        per_mini = len(batch) // mini_batches
        totals: dict[str, list[float]] = {}
        for i in range(mini_batches):
            mini = batch.select(slice(i * per_mini, (i + 1) * per_mini))
            local = self._dp_slice(mini)
            micro = self._micro_batches(local)
            scale = len(micro) * dp  # undo the schedule's 1/num_microbatches and DDP's 1/dp
            num_tokens = float(mini.response_mask.sum())
            num_seqs = float((mini.response_mask.sum(-1) > 0).sum())

            def loss_fn(mb: SequenceBatch, logits: torch.Tensor):
                # nothing reads the logits after the loss: the op's backward may overwrite them with their gradient
                stats = self._token_stats(logits, mb.tokens, inplace_backward=True)
                loss, metrics = policy_loss(
                    stats, mb.old_logp, mb.advantages, mb.response_mask, self.algo_cfg, ref_logp=mb.ref_logp,
                    num_tokens=num_tokens, num_seqs=num_seqs, target_ids=mb.tokens[:, 1:],
                )
                return loss * scale, {k: torch.tensor(float(v)) for k, v in metrics.items()} | {
                    "loss": loss.detach().clone()}

            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run_schedule(micro, loss_fn, forward_only=False, model=self.model)
            if self._all_finite(outputs):
                ok, grad_norm, _ = self.optimizer.step()
            else:  # a non-finite loss or gradient anywhere: every rank skips this step (the trainer counts them)
                ok, grad_norm = False, math.nan
            if ok:
                self.scheduler.step(increment=1)
            step_metrics = {"actor/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                            "actor/nonfinite": float(not ok), "actor/lr": self.optimizer.param_groups[0]["lr"]}
            if outputs:
                step_metrics["actor/loss"] = sum(float(o.pop("loss")) for o in outputs)
                parts = [{k: float(v) for k, v in o.items()} for o in outputs]
                step_metrics.update({f"loss/{k}": v for k, v in token_weighted_mean(parts).items()})
                step_metrics.update({f"loss/{k}": sum(p[k] for p in parts) for k in LOSS_TERMS if k in parts[0]})
            for key, value in step_metrics.items():
                totals.setdefault(key, []).append(value)
        metrics = {k: sum(v) / len(v) for k, v in totals.items()}
        summed = ("actor/loss", "loss/num_tokens", *(f"loss/{k}" for k in LOSS_TERMS))
        return _from_last_stage(_across_data_parallel(metrics, summed=summed))

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


def _across_data_parallel(metrics: dict[str, float], summed: tuple[str, ...]) -> dict[str, float]:
    """Each DP rank saw a slice of the mini-batch: sum the globally normalized loss, average the rest."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values, group=ps.get_data_parallel_group())
    return {k: float(v) if k in summed else float(v) / dp for k, v in zip(keys, values)}


def _from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """Loss metrics exist on the last pipeline stage; give every rank the same dict."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics if ps.is_pipeline_last_stage() else None]
    src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size() - 1)
    dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]
