"""The RLVR loop: generate -> reward -> advantages -> statistics -> update -> sync weights -> validate / log /
checkpoint.

Run under torchrun (one process per GPU, or per CPU worker with gloo): `megatron-rlvr train RECIPE.yaml k=v ...`.
Every rank runs the same loop; rank 0 alone writes metrics and the progress bar.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from megatron_rlvr import checkpoint, distributed
from megatron_rlvr.config import Config, differences, dump_config, load_config, to_dict
from megatron_rlvr.console import attach_log_file, has_log_file
from megatron_rlvr.data import PromptLoader, load_items
from megatron_rlvr.preemption import Preemption
from megatron_rlvr.validation import load_validation_items


class Timer:
    """Per-step wall-time breakdown: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[f"time/{name}"] = self.seconds.get(f"time/{name}", 0.0) + time.perf_counter() - start


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def train(cfg: Config) -> list[dict[str, float]]:
    """Run ``cfg`` to ``cfg.trainer.steps``, resuming from ``cfg.checkpoint.resume``; return the logged metrics.
    On SIGTERM or SIGUSR1 every rank finishes its step, a checkpoint is written and the run returns early."""
    with Preemption.installed() as preemption:
        return _train(cfg, preemption)


def _train(cfg: Config, preemption: Preemption) -> list[dict[str, float]]:
    from transformers import AutoTokenizer

    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.monitor import MetricLogger
    from megatron_rlvr.rewards import RewardPool

    distributed.init_process_group()
    cfg.validate(distributed.world_size(), load_hf_config(cfg.model.hf_dir))
    t = cfg.trainer
    roles = None
    if cfg.rollout.placement == "separate":  # the last rollout.engine_ranks ranks serve engines from here on
        from megatron_rlvr.roles import pin_cpu_cores, split_roles

        roles = split_roles(cfg.rollout.engine_ranks)
        pin_cpu_cores()  # an engine rank and an actor rank on different cores (DESIGN.md)
        if roles.is_engine:
            from megatron_rlvr.rollout.engine_rank import serve

            serve(cfg, roles)
            return []
    from megatron_rlvr.actor import MegatronActor
    from megatron_rlvr.experience_source import make_source

    distributed.initialize_model_parallel(cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, seed=t.seed)
    rank0 = distributed.rank() == 0
    out = Path(t.output_dir)
    ckpt_root = out / "checkpoints"
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_config(cfg))

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    items, stats = load_items(cfg.data, tokenizer, "train")
    loader = PromptLoader(items, t.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    val_items = load_validation_items(cfg, tokenizer) if t.eval_every else []
    if rank0:
        print(f"[data] {len(items)} prompts from {stats.rows} rows ({stats.bad_rows} bad rows skipped, "
              f"{stats.too_long} over data.max_prompt_tokens skipped)", flush=True)
        for warning in cfg.warnings():
            print(f"[config] warning: {warning}", file=sys.stderr, flush=True)
    actor = MegatronActor(cfg.model, cfg.actor, cfg.algo, temperature=cfg.rollout.temperature, total_steps=t.steps)

    start_step, nonfinite_in_a_row, history, preempted, pending = 0, 0, [], False, None
    resume_from = checkpoint.resolve(ckpt_root, cfg.checkpoint.resume)
    if resume_from is not None:
        state = checkpoint.load(resume_from, actor)
        loader.load_state_dict(state["loader"])
        pending = checkpoint.load_object(resume_from, "pending_rollout")  # one-step-off: the step sampled ahead
        changed = differences(state["config"], to_dict(cfg)) if "config" in state else []
        if rank0 and changed:  # e.g. more steps on purpose, or another recipe by mistake in the same directory
            print(f"[resume] {resume_from} was written with another config; now: " + "; ".join(changed), flush=True)
        start_step, nonfinite_in_a_row = state["step"], state.get("nonfinite_in_a_row", 0)
    logger = MetricLogger(
        str(out), tensorboard=t.tensorboard, wandb_project=t.wandb_project, resume_step=start_step or None
    ) if rank0 else None
    progress = _progress(rank0, start_step, t.steps)

    def run_validation(step: int, timer: Timer | None = None) -> dict[str, float]:
        with timer("eval") if timer else contextlib.nullcontext():
            metrics, entropy = source.validate(step, val_items, pad_id)
        if logger is not None:
            logger.log_histogram(step, "val/entropy", entropy)
        return metrics

    with RewardPool(cfg.reward) as pool:
        # colocated: this rank's engine; separate: the engine ranks, fed with the actor's weights
        source = make_source(cfg, roles, actor, pool, loader, pad_id, start_step=start_step, pending=pending)
        anchor = _pba_anchor(cfg, source, pool, items, out / "base_evidence.json", start_step) if cfg.algo.pba else None
        history, preempted = _loop(cfg, actor, source, preemption, logger, progress, run_validation, ckpt_root,
                                   start_step, nonfinite_in_a_row, bool(val_items), anchor)
        # not after an error: a rank that raised alone must exit (engine ranks see it go and exit too), not wait here
        source.close()
    if t.save_hf and not preempted:
        checkpoint.save_hf(actor, cfg.model.hf_dir, out / "hf", cfg.rollout.bucket_bytes)
    if logger is not None:
        logger.close()
        progress.close()
    return history


def _loop(cfg: Config, actor, source, preemption: Preemption, logger, progress, run_validation, ckpt_root: Path,
          start_step: int, nonfinite_in_a_row: int, validating: bool,
          anchor=None) -> tuple[list[dict[str, float]], bool]:
    """Steps ``start_step`` .. ``trainer.steps``: experience -> statistics -> update -> weights out -> validation,
    logs, checkpoint. Returns the logged metrics and whether a preemption stopped it."""
    t, history, preempted = cfg.trainer, [], False
    if validating and start_step == 0:  # the base model's numbers, the reference every later validation meets
        base = run_validation(0)
        if logger is not None:
            logger.log(0, base)
    for step in range(start_step, t.steps):
        timer = Timer()
        with timer("rollout+reward"):
            exp, source_metrics = source.next(step)
        if anchor is not None:  # PBA: per-response KL coefficients from the base's evidence on each prompt
            exp.batch.kl_coef, pba_stats = anchor(exp.items)
            source_metrics |= pba_stats
        with timer("statistics"):
            if actor.needs_statistics_pass(t.mini_batches_per_step):  # else update() fills batch.old_logp
                exp.batch.old_logp = actor.compute_old_logp(exp.batch)
            if actor.reference is not None:  # algo.kl_coef > 0, or PBA's anchor: the loss's KL term
                exp.batch.ref_logp = actor.compute_ref_logp(exp.batch)
            if actor.teacher is not None:  # algo.distill: the frozen teacher scores the response tokens
                actor.teacher.attach(actor, exp.batch, exp.items)
        with timer("update"):
            update_metrics = actor.update(exp.batch, t.mini_batches_per_step)
        nonfinite_in_a_row = nonfinite_in_a_row + 1 if update_metrics.get("actor/nonfinite", 0) else 0
        if nonfinite_in_a_row > cfg.actor.max_nonfinite_in_a_row:
            raise NonFiniteError(
                f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(actor.max_nonfinite_in_a_row={cfg.actor.max_nonfinite_in_a_row}); stopping at step {step}"
            )
        with timer("sync"):
            source_metrics |= source.after_update(step)
        if validating and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            update_metrics |= run_validation(step + 1, timer)
        metrics = {"step": step + 1, **_rollout_metrics(exp), **_named(update_metrics), **source_metrics,
                   **timer.seconds}
        history.append(metrics)
        if logger is not None:
            logger.log(step + 1, metrics)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", loss=f"{metrics.get('actor/loss', 0):.4f}")
        preempted = preemption.requested()  # a collective: every rank stops after the same step
        if preempted or (cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0):
            state = {**source.state_dict(), "nonfinite_in_a_row": nonfinite_in_a_row, "config": to_dict(cfg)}
            checkpoint.save(ckpt_root, step + 1, actor, state, cfg.checkpoint.keep_last, hf_dir=cfg.model.hf_dir,
                            objects={"pending_rollout": source.pending()})
        if preempted:
            if logger is not None:
                print(f"[preempt] {preemption.reason}: stopped after step {step + 1} with its checkpoint; "
                      "rerun the same command to resume", flush=True)
            break
    return history, preempted


def _pba_anchor(cfg: Config, source, pool, items, path: Path, start_step: int):
    """PBA: the frozen base's correct counts per training prompt (drawn now, before the first update, or read back
    from ``path``) and a function from a step's prompts to per-response KL coefficients and the pba/* metrics."""
    from megatron_rlvr.algos.pba import pba_metrics, sequence_kl_coef
    from megatron_rlvr.base_evidence import base_evidence
    from megatron_rlvr.config import ConfigError

    if start_step > 0 and not path.is_file():  # the engine now holds trained weights: they are not the base
        raise ConfigError(f"algo.pba: resuming at step {start_step} but {path} (the base's evidence) is missing; "
                          "start the run afresh or restore the file")
    # colocated: this rank's engine; separate: the engine ranks, which hold the initial weights (version 0) here
    evidence = base_evidence(source.engine, pool, items, cfg, path, run_seed=cfg.trainer.seed)

    def anchor(step_items) -> tuple[torch.Tensor, dict[str, float]]:
        correct = torch.tensor([evidence[item.id] for item in step_items])
        return sequence_kl_coef(correct, cfg.rollout.group_size, cfg.algo), pba_metrics(correct, cfg.algo)

    return anchor


def _rollout_metrics(exp) -> dict[str, float]:
    batch = exp.batch
    mask = batch.response_mask
    mismatch = ((exp.engine_logp - batch.old_logp).abs() * mask).sum() / mask.sum().clamp_min(1)
    metrics = {
        **exp.metrics,  # reward/*, response/* over every response sampled, batch/* (dynamic sampling)
        "response/tokens_trained": float(mask.sum()),
        # |engine log-prob - actor log-prob| on sampled tokens: the train/inference mismatch
        "rollout/logp_mismatch": float(mismatch),
    }
    metrics.update({f"reward/{k}": float(v) for k, v in exp.reward_counters.items()})
    return metrics


def _named(update_metrics: dict[str, float]) -> dict[str, float]:
    """The actor logs every loss metric as loss/<key>; the rollout correction's and distillation's keep their own
    family."""
    own = ("loss/rollout_correction/", "loss/distill/")
    return {k[len("loss/"):] if k.startswith(own) else k: v for k, v in update_metrics.items()}


def _progress(enabled: bool, start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", disable=not enabled, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlvr train", description=__doc__)
    parser.add_argument("config", help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.tp=2 algo.alpha=0.05")
    parser.add_argument("--resume", default=None, help="'latest' (default from the recipe), a checkpoint dir, or 'none'")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={'null' if args.resume == 'none' else args.resume}")
    cfg = load_config(args.config, overrides)
    if not has_log_file():  # the demo has its own; `train` alone: <output_dir>/logs/train-rank<r>.log
        attach_log_file(cfg.trainer.output_dir, "train")  # vLLM / megatron-core lines go there, off the console
    history = train(cfg)
    if distributed.rank() == 0 and history:
        last = history[-1]
        print(f"done: {len(history)} steps, final reward {last['reward/mean']:.3f}", flush=True)
    return 0 if all(math.isfinite(h.get("actor/loss", 0.0)) for h in history) else 1
