"""The RLVR loop: experience (generate -> reward -> advantages) -> the algorithm's experience transforms ->
statistics -> update -> sync weights -> validate / log / checkpoint.

Run under torchrun (one process per GPU, or per CPU worker with gloo): `megatron-rlvr train RECIPE.yaml k=v ...`;
on one machine `megatron-rlvr train --nproc-per-node N RECIPE.yaml k=v ...` checks the run and starts the N ranks.
Every rank runs the same loop; rank 0 alone writes metrics and the progress bar. Under separate placement the last
``rollout.engine_ranks`` ranks serve the engines instead (experience/engine_server.py) and the loop reads their
experience through the same `ExperienceSource` (docs/design.md, "One training step"). The loop names no algorithm:
what an algorithm changes in a step's experience is a transform it registers (experience/transforms.py), what it
changes in the loss is read by the actor from its config section. The components a caller may replace (the reward
function, the actor, the engines, a step's collection, the checkpoint writer) are `Parts`, passed to `train`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr import checkpoint
from megatron_rlvr.checkpoint import ShardWriter
from megatron_rlvr.config import Config, differences, dump_config, load_config, to_dict, upgraded
from megatron_rlvr.data import PromptItem
from megatron_rlvr.experience.collect import collect
from megatron_rlvr.experience.colocated import CollectStep
from megatron_rlvr.experience.construction import EngineFactory, make_rollout_engine
from megatron_rlvr.experience.validation import load_validation_items
from megatron_rlvr.protocols.actor import Actor
from megatron_rlvr.rewards import RewardConfig, RewardPool
from megatron_rlvr.runtime import distributed
from megatron_rlvr.runtime.console import attach_log_file, has_log_file
from megatron_rlvr.runtime.preemption import Preemption

if TYPE_CHECKING:  # imported when the loop starts (they import megatron-core, vLLM, TensorBoard)
    from tqdm import tqdm

    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.experience.collect import Experience
    from megatron_rlvr.experience.source import ExperienceSource
    from megatron_rlvr.experience.transforms import Transforms
    from megatron_rlvr.monitor import MetricLogger
    from megatron_rlvr.runtime.roles import Roles


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


RewardsFactory = Callable[[RewardConfig], RewardPool]  # a context manager that scores every response of the run
ActorFactory = Callable[[Config], Actor]


def megatron_actor(cfg: Config, subclass: type[MegatronActor] | None = None) -> Actor:
    """The run's actor on megatron-core (imported here, when the loop starts); ``subclass``: built as that
    subclass of `MegatronActor` instead (a test's recorder)."""
    from megatron_rlvr.actor.megatron_actor import MegatronActor

    r = cfg.rollout
    return (subclass or MegatronActor)(
        cfg.model,
        cfg.actor,
        cfg.algo,
        temperature=r.temperature,
        total_steps=cfg.trainer.steps,
        group_size=r.group_size,
    )


@dataclass(frozen=True)
class Parts:
    """The components of a run a caller may replace, each the real one by default: ``train(cfg, Parts(rewards=f))``
    is how a test passes a fake (megatron_rlvr/testing/loop_fakes.py), or a user a reward function of their own.
    ``engine`` and ``collect`` are the colocated placement's: the engine ranks of ``rollout.placement: separate``
    build and drive their engines where they run."""

    rewards: RewardsFactory = RewardPool  # scores every response: the samples, what transforms sample, validation
    actor: ActorFactory = megatron_actor
    engine: EngineFactory = make_rollout_engine  # this rank's engine, built again after it died
    collect: CollectStep = collect  # one step's experience; retried once by the source after an engine died
    checkpoint_writer: ShardWriter = checkpoint.write_shards  # the actor's shards of every checkpoint


@dataclass
class Run:
    """What the loop reads: the run's config, its actor, experience source and the algorithm's transforms of the
    experience, and where it logs and saves."""

    cfg: Config
    actor: Actor
    source: ExperienceSource
    transforms: Transforms
    preemption: Preemption
    logger: MetricLogger | None  # rank 0's; None elsewhere
    progress: tqdm  # disabled off rank 0
    ckpt_root: Path
    val_items: list[PromptItem]
    pad_id: int
    start_step: int
    nonfinite_in_a_row: int

    def validate(self, step: int, timer: Timer | None = None) -> dict[str, float]:
        with timer("eval") if timer else contextlib.nullcontext():
            metrics, entropy = self.source.validate(step, self.val_items, self.pad_id)
        if self.logger is not None:
            self.logger.log_histogram(step, "val/entropy", entropy)
        return metrics


def train(cfg: Config, parts: Parts = Parts()) -> list[dict[str, float]]:  # noqa: B008 (frozen: shared safely)
    """Run ``cfg`` to ``cfg.trainer.steps``, resuming from ``cfg.checkpoint.resume``; return the logged metrics.
    On SIGTERM or SIGUSR1 every rank finishes its step, a checkpoint is written and the run returns early. ``parts``:
    the components replaced (see `Parts`)."""
    with Preemption.installed() as preemption:
        distributed.init_process_group()
        cfg.preflight(distributed.world_size())
        roles = None
        if cfg.rollout.placement == "separate":  # the last rollout.engine_ranks ranks serve engines from here on
            from megatron_rlvr.experience.engine_server import serve
            from megatron_rlvr.experience.transforms import source_config
            from megatron_rlvr.runtime.roles import pin_cpu_cores, split_roles

            roles = split_roles(cfg.rollout.engine_ranks)
            pin_cpu_cores()  # an engine rank and an actor rank on different cores (docs/separate-placement.md)
            if roles.is_engine:  # sampling as the actor's source does (experience/transforms.py)
                serve(source_config(cfg), roles)
                return []
        return _train(cfg, roles, preemption, parts)


def _train(cfg: Config, roles: Roles | None, preemption: Preemption, parts: Parts) -> list[dict[str, float]]:
    from megatron_rlvr.experience.construction import prompt_stream
    from megatron_rlvr.experience.source import make_source
    from megatron_rlvr.experience.transforms import Transforms, TransformSetup, source_config
    from megatron_rlvr.monitor import MetricLogger
    from megatron_rlvr.rewards.containment import check_run_containment

    t = cfg.trainer
    distributed.initialize_model_parallel(
        cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, seed=t.seed, ep=cfg.actor.ep, etp=cfg.actor.etp, cp=cfg.actor.cp
    )
    rank0 = distributed.rank() == 0
    out = Path(t.output_dir)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_config(cfg))

    prompts = prompt_stream(cfg)
    val_items = load_validation_items(cfg, prompts.tokenizer) if t.eval_every else []
    # policy-written programs (code rows, the Python tool) get isolation, or the run stops here with one line
    check_run_containment(cfg.reward, {i.task for i in [*prompts.items, *val_items]}, cfg.environment.name)
    if rank0:
        print(
            f"[data] {len(prompts.items)} prompts from {prompts.stats.rows} rows ({prompts.stats.bad_rows} bad rows "
            f"skipped, {prompts.stats.too_long} over data.max_prompt_tokens skipped)",
            flush=True,
        )
        for warning in cfg.warnings():
            print(f"[config] warning: {warning}", file=sys.stderr, flush=True)
    actor = parts.actor(cfg)

    ckpt_root = out / "checkpoints"
    start_step, nonfinite_in_a_row, pending = 0, 0, None
    resume_from = checkpoint.resolve(ckpt_root, cfg.checkpoint.resume)
    if resume_from is not None:
        state = checkpoint.load(resume_from, actor)
        prompts.loader.load_state_dict(state["loader"])
        # one-step-off: the step sampled ahead; streamed: the stream's state (finished groups, responses in flight)
        pending = checkpoint.load_object(resume_from, "pending_rollout")
        # a checkpoint written before keys moved is read with today's keys (config/renamed.py)
        changed = differences(upgraded(state["config"]), to_dict(cfg)) if "config" in state else []
        if rank0 and changed:  # e.g. more steps on purpose, or another recipe by mistake in the same directory
            print(f"[resume] {resume_from} was written with another config; now: " + "; ".join(changed), flush=True)
        start_step, nonfinite_in_a_row = state["step"], state.get("nonfinite_in_a_row", 0)
    logger = (
        MetricLogger(str(out), tensorboard=t.tensorboard, wandb_project=t.wandb_project, resume_step=start_step or None)
        if rank0
        else None
    )
    progress = _progress(rank0, start_step, t.steps)

    with parts.rewards(cfg.reward) as pool:
        # colocated: this rank's engine; separate: the engine ranks, fed with the actor's weights. The source samples
        # each group less the samples the run's transforms add themselves
        source = make_source(
            source_config(cfg),
            roles,
            actor,
            pool,
            prompts.loader,
            prompts.pad_id,
            start_step=start_step,
            pending=pending,
            make_engine=parts.engine,
            collect_step=parts.collect,
        )
        setup = TransformSetup(
            cfg,
            source.engine,
            pool,
            prompts.loader,
            prompts.items,
            prompts.tokenizer,
            prompts.pad_id,
            actor,
            out,
            start_step,
        )
        run = Run(
            cfg,
            actor,
            source,
            Transforms.build(setup),
            preemption,
            logger,
            progress,
            ckpt_root,
            val_items,
            prompts.pad_id,
            start_step,
            nonfinite_in_a_row,
        )
        history, preempted = _loop(run, parts.checkpoint_writer)
        # not after an error: a rank that raised alone must exit (engine ranks see it go and exit too), not wait here
        source.close()
    if t.save_hf and not preempted:
        checkpoint.save_hf(actor, cfg.model.hf_dir, out / "hf", cfg.rollout.bucket_bytes)
        checkpoint.save_adapter(actor, out / "adapter", cfg.rollout.bucket_bytes)  # actor.lora: PEFT's format too
    if logger is not None:
        logger.close()
        progress.close()
    return history


def _loop(run: Run, checkpoint_writer: ShardWriter) -> tuple[list[dict[str, float]], bool]:
    """Steps ``start_step`` .. ``trainer.steps``: experience -> transforms -> statistics -> update -> weights out ->
    validation, logs, checkpoint. Returns the metrics of every step and whether a preemption stopped it."""
    cfg, actor, source = run.cfg, run.actor, run.source
    t, history, preempted, nonfinite_in_a_row = cfg.trainer, [], False, run.nonfinite_in_a_row
    validating = bool(run.val_items)
    if validating and run.start_step == 0:  # the base model's numbers, the reference every later validation meets
        base = run.validate(0)
        if run.logger is not None:
            run.logger.log(0, base)
    for step in range(run.start_step, t.steps):
        timer = Timer()
        with timer("rollout+reward"):
            prepared = run.transforms.before(step)  # e.g. a reference that samples before the step's prompts do
            exp, source_metrics = source.next(step)
            exp = run.transforms(step, exp)
            source_metrics = source_metrics | prepared
        with timer("statistics"):  # behaviour log-probs, the KL reference's, the teacher's: what the loss reads
            statistics = actor.score(exp.rollouts, exp.items, mini_batches=t.mini_batches_per_step)
        with timer("update"):
            update_metrics = actor.update(exp.rollouts, exp.targets, statistics, mini_batches=t.mini_batches_per_step)
        nonfinite_in_a_row = nonfinite_in_a_row + 1 if update_metrics.get("actor/nonfinite", 0) else 0
        if nonfinite_in_a_row > cfg.actor.max_nonfinite_in_a_row:
            raise NonFiniteError(
                f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(actor.max_nonfinite_in_a_row={cfg.actor.max_nonfinite_in_a_row}); stopping at step {step}"
            )
        with timer("sync"):
            source_metrics |= source.after_update(step)
        last = step + 1 == t.steps
        validated = run.validate(step + 1, timer) if validating and ((step + 1) % t.eval_every == 0 or last) else {}
        metrics = {
            "step": step + 1,
            **_rollout_metrics(exp),
            **update_metrics,
            **validated,
            **source_metrics,
            **timer.seconds,
        }
        history.append(metrics)
        preempted = run.preemption.requested()  # a collective: every rank stops after the same step
        if run.logger is not None:
            if (step + 1) % t.log_every == 0 or last or preempted:
                run.logger.log(step + 1, metrics)
                if exp.staleness is not None:  # streamed: each trained response's staleness (docs/async.md)
                    k = cfg.rollout.max_staleness  # one bin per update of lag, 0 .. k
                    run.logger.log_histogram(
                        step + 1, "rollout/staleness", exp.staleness.tolist(), k + 1, (-0.5, k + 0.5)
                    )
            run.progress.update(1)
            run.progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", loss=f"{metrics.get('actor/loss', 0):.4f}")
        if preempted or (cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0):
            state = {**source.state_dict(), "nonfinite_in_a_row": nonfinite_in_a_row, "config": to_dict(cfg)}
            saved = checkpoint.save(
                run.ckpt_root,
                step + 1,
                actor,
                state,
                cfg.checkpoint.keep_last,
                hf_dir=cfg.model.hf_dir,
                objects={"pending_rollout": source.pending()},
                writer=checkpoint_writer,
            )
        if preempted:
            if run.logger is not None:
                run.progress.close()  # the bar's last state first: the stop's line is the run's last
                print(
                    f"[preempt] {run.preemption.reason}: stopped after step {step + 1} with its checkpoint "
                    f"{saved}; rerun the same command to resume",
                    flush=True,
                )
            break
    return history, preempted


def _rollout_metrics(exp: Experience) -> dict[str, float]:
    metrics = {
        **exp.metrics,  # reward/*, response/* over every response sampled, batch/* (dynamic sampling)
        "response/tokens_trained": float(exp.rollouts.response_mask.sum()),
    }
    metrics.update({f"reward/{k}": float(v) for k, v in exp.reward_counters.items()})
    return metrics


def _progress(enabled: bool, start: int, total: int) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", disable=not enabled, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlvr train", description=__doc__)
    parser.add_argument("config", help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.tp=2 algo.loss.alpha=0.05")
    parser.add_argument(
        "--resume", default=None, help="'latest' (default from the recipe), a checkpoint dir, or 'none'"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine (torchrun --standalone), after checking the config, its layout for N "
        "ranks and its input files here: a mistake is one line before any rank starts",
    )
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={'null' if args.resume == 'none' else args.resume}")
    if args.nproc_per_node is not None:
        return _start_ranks(args.config, overrides, args.nproc_per_node)
    cfg = load_config(args.config, overrides)
    if "RANK" not in os.environ:  # one process, a world of one (runtime/distributed.py): checked before it writes
        _check_one_process(cfg, args.config, overrides)
    if not has_log_file():  # the demo has its own; `train` alone: <output_dir>/logs/train-rank<r>.log
        attach_log_file(cfg.trainer.output_dir, "train")  # vLLM / megatron-core lines go there, off the console
    history = train(cfg)
    if distributed.rank() == 0 and history and history[-1]["step"] == cfg.trainer.steps:  # else a stop said its line
        print(_done_line(history, Path(cfg.trainer.output_dir)), flush=True)
    return 0 if all(math.isfinite(h.get("actor/loss", 0.0)) for h in history) else 1


def _done_line(history: list[dict[str, float]], out: Path) -> str:
    """The run's last line: its steps and final reward, and where its outputs are (those it wrote)."""
    outputs = [
        f"{what} {path}"
        for what, path in (("checkpoints", out / "checkpoints"), ("model", out / "hf"), ("adapter", out / "adapter"))
        if path.is_dir()
    ]
    where = f"; {', '.join(outputs)}" if outputs else ""
    steps = f"{len(history)} step{'s' if len(history) != 1 else ''}"
    return f"done: {steps}, final reward {history[-1]['reward/mean']:.3f}{where}"


def _check_one_process(cfg: Config, config: str, overrides: list[str]) -> None:
    """`train` outside torchrun is a world of one process: `Config.preflight` for it, and a layout that needs more
    ranks (and fits them) is also told how to start them."""
    from megatron_rlvr.errors import UserError
    from megatron_rlvr.models.layout import LayoutError

    try:
        cfg.preflight(1)
    except LayoutError as error:
        separate = cfg.rollout.placement == "separate"
        ranks = cfg.actor.layout().model_parallel + (cfg.rollout.engine_ranks if separate else 0)
        try:
            cfg.preflight(ranks)
        except UserError:
            raise error from None
        command = shlex.join(["megatron-rlvr", "train", "--nproc-per-node", str(ranks), config, *overrides])
        raise LayoutError(f"{error}; or start {ranks} ranks: {command}") from None


def _start_ranks(config: str, overrides: list[str], nproc: int) -> int:
    """`train --nproc-per-node N`: `Config.preflight` for N ranks here, then torchrun on this machine through
    `console.torchrun`, so that a user error met inside a rank is one line and exit 2 as well."""
    from megatron_rlvr.errors import ConfigError
    from megatron_rlvr.runtime.console import torchrun

    if "RANK" in os.environ:
        raise ConfigError("--nproc-per-node: this process is already a rank of a world (RANK is set); drop it")
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node: expected >= 1, got {nproc}")
    load_config(config, overrides).preflight(nproc)
    return torchrun(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "megatron_rlvr.cli", "train", config, *overrides]
    )
