"""`megatron-rlvr eval`: sample n answers per problem from one or several HF models, verify, tabulate pass@k.

    megatron-rlvr eval --model MODEL_DIR [MODEL_DIR ...] [--label NAME ...] --benchmarks math500 aime24 \
        --data-dir data --n 1024 --out outputs/eval

    megatron-rlvr eval --estimate ...same flags...     (draws each model's first request, prints the cost: estimate.py)
    megatron-rlvr estimate RECIPE [key=value ...]       (a recipe's cost without sampling: recipes/estimate.py)
    megatron-rlvr eval compare RUN_A RUN_B             (paired comparison of two runs: compare.py)

This module is the command line only: flags -> EvalConfig, then api.py's `evaluate` or `estimate` with the vLLM
engine and the model's tokenizer, and a user error -> one line. Outputs, resuming and torchrun: api.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_rlvr.environments.config import EnvironmentConfig
from megatron_rlvr.environments.loading import check_environment
from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.api import estimate, evaluate, hf_encoder_factory, model_tags, vllm_engine_factory
from megatron_rlvr.eval.bootstrap import IntervalSpec
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.estimate import format_estimate
from megatron_rlvr.eval.report import markdown_table
from megatron_rlvr.eval.runner import EvalConfigError
from megatron_rlvr.problems.benchmarks import BENCHMARKS
from megatron_rlvr.rewards.answers import ANSWER_FORMATS
from megatron_rlvr.rewards.config import RewardConfig


class ModelDirError(UserError, FileNotFoundError):
    """A --model argument is not an HF model directory."""


def build_parser() -> argparse.ArgumentParser:
    d = EvalConfig()
    parser = argparse.ArgumentParser(prog="megatron-rlvr eval", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", required=True, help="HF model directories (several: one comparison table)"
    )
    parser.add_argument(
        "--label",
        nargs="+",
        default=None,
        help="a name for each --model, in order: its row in the table, its run directory under --out and its "
        "progress bar (default: the last path parts that tell the models apart, e.g. 'hf')",
    )
    parser.add_argument(
        "--benchmarks", nargs="+", required=True, help=f"any of {', '.join(BENCHMARKS)} (space or comma separated)"
    )
    parser.add_argument(
        "--data-dir", default=d.data_dir, help="local benchmark files (docs/evaluation.md, 'Benchmark files')"
    )
    parser.add_argument("--n", type=int, default=d.n_samples, help="samples per problem (up to 1024 and beyond)")
    parser.add_argument(
        "--chunk", type=int, default=d.chunk, help="samples per problem in one request (unit of seeding and resume)"
    )
    parser.add_argument(
        "--request-samples",
        type=int,
        default=d.request_samples,
        help="sequences per engine request: chunk j of request_samples // chunk problems at once",
    )
    parser.add_argument("--out", default=d.output_dir, help="output directory (rerun with the same one to resume)")
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--top-p", type=float, default=d.top_p)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=d.dtype,
        help="the engines' weights and compute (bfloat16 on GPUs)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--limit", type=int, default=0, help="first N problems of each benchmark (0 = all)")
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap prompts with the tokenizer's chat template; answers end at its end-of-turn token",
    )
    parser.add_argument(
        "--system-prompt",
        default=None,
        help="the system turn under --chat-template (default: the template's own system prompt)",
    )
    parser.add_argument(
        "--answer",
        choices=ANSWER_FORMATS,
        default=RewardConfig().answer,
        help="how a reasoning-gym answer is read from the response (reward.answer): tagged, last_number, boxed",
    )
    parser.add_argument("--no-text", action="store_true", help="do not keep sample texts in the records")
    parser.add_argument("--max-model-len", type=int, default=4096, help="engine context: prompt + new tokens")
    parser.add_argument(
        "--environment",
        default="",
        help="multi-turn: each sample a trajectory against this environment (environment.name: python_tool, "
        "package.module:factory or FILE.py:factory; docs/multi-turn.md); --max-new-tokens is its token budget",
    )
    parser.add_argument("--max-turns", type=int, default=4, help="with --environment: the policy's turns at most")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="engine tensor-parallel size (GPU); under torchrun, WORLD_SIZE / tp engines split the problems",
    )
    parser.add_argument("--workers", type=int, default=RewardConfig().workers, help="verifier processes")
    parser.add_argument(
        "--sandbox-accept-rlimits-only",
        action="store_true",
        help="code benchmarks where no namespace can be had (no root, user namespaces off): run the programs with "
        "rlimits only, with this host's files and network (reward.sandbox_accept_rlimits_only; docs/sandbox.md)",
    )
    spec = IntervalSpec()
    parser.add_argument("--resamples", type=int, default=spec.resamples, help="bootstrap resamples of the intervals")
    parser.add_argument("--level", type=float, default=spec.level, help="confidence level of the intervals")
    parser.add_argument(
        "--interval-seed",
        type=int,
        default=spec.seed,
        help="bootstrap seed (the same seed gives the same intervals); not the sampling --seed",
    )
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="print the job's samples, tokens, wall time and GPU-hours, from a calibration (each "
        "model's first request, kept) or recorded figures, and stop",
    )
    parser.add_argument(
        "--recorded",
        help="with --estimate: a run directory of the same model and settings whose "
        "timing.jsonl gives the figures (no calibration)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[EvalConfig, RewardConfig]:
    benchmarks = [b for item in args.benchmarks for b in item.split(",") if b]
    unknown = [b for b in benchmarks if b not in BENCHMARKS]
    if unknown:
        raise EvalConfigError(f"--benchmarks: unknown {unknown}; expected any of {sorted(BENCHMARKS)}")
    cfg = EvalConfig(
        n_samples=args.n,
        chunk=min(args.chunk, args.n),
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=list(args.stop),
        seed=args.seed,
        benchmarks=benchmarks,
        data_dir=args.data_dir,
        output_dir=args.out,
        limit=args.limit,
        chat_template=args.chat_template,
        system_prompt=args.system_prompt,
        save_text=not args.no_text,
        request_samples=args.request_samples,
        dtype=args.dtype,
    )
    if args.system_prompt is not None and not args.chat_template:
        raise EvalConfigError("--system-prompt: a system turn needs --chat-template")
    reward = RewardConfig(
        workers=args.workers, answer=args.answer, sandbox_accept_rlimits_only=args.sandbox_accept_rlimits_only
    )
    return cfg, reward


def main(argv: list[str] | None = None) -> int:
    from megatron_rlvr.runtime.console import report_user_error, setup_console

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:  # sub-verbs: no flag of `eval` is a bare word, so none can shadow them
        from megatron_rlvr.eval.compare import main as compare_main

        return compare_main(argv[1:])
    args = build_parser().parse_args(argv)
    setup_console()
    try:
        cfg, reward_cfg = config_from_args(args)
        spec = IntervalSpec(args.resamples, args.level, args.interval_seed)
        for model in args.model:
            if not (Path(model) / "config.json").is_file():
                raise ModelDirError(f"--model {model}: not an HF model directory (no config.json)")
        model_tags(args.model, args.label)  # a bad --label: before any engine starts
        if args.recorded and not args.estimate:
            raise EvalConfigError("--recorded: only with --estimate")
        if args.max_turns < 1:
            raise EvalConfigError(f"--max-turns: expected >= 1, got {args.max_turns}")
        environment = EnvironmentConfig(name=args.environment, max_turns=args.max_turns)
        check_environment(environment)
        factory = vllm_engine_factory(args.max_model_len, tp=args.tp, environment=environment, reward=reward_cfg)
        if args.estimate:
            job = estimate(
                args.model,
                cfg,
                reward_cfg,
                factory,
                hf_encoder_factory,
                tp=args.tp,
                recorded=args.recorded,
                labels=args.label,
            )
            if job is not None:
                print(format_estimate(job), end="")
            return 0
        ks, rows, written = evaluate(
            args.model,
            cfg,
            reward_cfg,
            factory,
            hf_encoder_factory,
            tp=args.tp,
            spec=spec,
            labels=args.label,
            environment=environment.name,
        )
    except UserError as exc:
        return report_user_error(exc)
    if rows:  # rank 0 only
        print(markdown_table(ks, rows, spec))
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
