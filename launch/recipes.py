"""Recipes: find one by name, load it with overrides, and validate and plan it before anything is submitted.

A recipe is a YAML file in configs/. Where a recipe and its model's config.json are found (the checkpoint's own
directory when readable here, else the architecture copy in `configs/models/<Name>/`) is
`megatron_rlvr.plan.recipe_files`, shared with `megatron-rlvr plan`; its names are re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path

from launch.executors import REPO_ROOT  # noqa: F401 - the launch tests' name
from megatron_rlvr.config import Config, dump_config, load_config
from megatron_rlvr.errors import ConfigError, UserError
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.models.layout import ParallelLayout
from megatron_rlvr.plan.recipe_files import (  # noqa: F401 - the launchers' and the recipe tests' names
    CONFIGS_DIR,
    MODEL_CONFIGS_DIR,
    documented_nodes,
    find_hf_config,
    find_recipe,
    hf_config_path,
    recipe_names,
)


def model_dims(cfg: Config) -> ModelDims | None:
    """The shapes of the recipe's model (its config.json, or the architecture copy in configs/models/), if found."""
    hf = find_hf_config(cfg.model.hf_dir)
    return None if hf is None else ModelDims.from_hf(hf)


def load_and_validate(
    recipe: str, overrides: list[str], world_size: int | None, require_model: bool = False
) -> tuple[Path, Config]:
    """Load recipe + overrides and run `Config.validate` against the world size and the model's shape.

    `require_model`: fail when no config.json is found for `model.hf_dir` (the recipe tests use it, so every
    paper recipe keeps its architecture copy in configs/models/).
    """
    path = find_recipe(recipe)
    cfg = load_config(path, overrides)
    dims = model_dims(cfg)
    if dims is None and require_model:
        raise ConfigError(
            f"model.hf_dir={cfg.model.hf_dir!r}: no config.json there or in "
            f"{MODEL_CONFIGS_DIR / Path(cfg.model.hf_dir).name}"
        )
    cfg.validate(world_size=world_size, dims=dims)
    return path, cfg


def check_engine_layout(cfg: Config, world_size: int) -> None:
    """An eval job's engines: rollout.tp divides the model's heads (the layout rules of models/layout.py, as for an
    engine) and the job's ranks, each engine spanning rollout.tp of them."""
    from launch.options import LaunchError

    ParallelLayout(tp=cfg.rollout.tp).check(model_dims(cfg), prefix="rollout.", training=False)
    if world_size % cfg.rollout.tp:
        raise LaunchError(
            f"the job's {world_size} ranks are not a multiple of rollout.tp={cfg.rollout.tp} (one engine per "
            f"rollout.tp ranks); give --nproc-per-node {cfg.rollout.tp} or a multiple"
        )


def check_local_inputs(subcommand: str, cfg: Config) -> None:
    """A job of the local executors reads this machine's files, from the repository root (where its ranks start):
    the ones it needs are there, or a UserError names the file and what writes it. Training: `Config.check_inputs`;
    evaluation: the model's config.json and each benchmark's data file."""
    from megatron_rlvr.problems.benchmarks import benchmark_files

    os.chdir(REPO_ROOT)  # relative paths: as the job will read them
    if subcommand == "train":
        cfg.check_inputs()
        return
    if not (Path(cfg.model.hf_dir) / "config.json").is_file():
        raise ConfigError(
            f"model.hf_dir={cfg.model.hf_dir}: not an HF model directory (no config.json under {REPO_ROOT} or as "
            "an absolute path); give the model to evaluate, e.g. model.hf_dir=<trainer.output_dir>/hf"
        )
    for name in cfg.eval.benchmarks:
        benchmark_files(name, cfg.eval.data_dir)


def resolved_yaml(path: Path, cfg: Config, overrides: list[str]) -> str:
    """The exact config a job runs, with where it came from, as the file shipped with the job."""
    header = f"# resolved from {path.name}" + (f" with {' '.join(overrides)}" if overrides else "") + "\n"
    return header + dump_config(cfg)


PATH_KEYS = ("model.hf_dir", "model.load", "data.path", "trainer.output_dir", "eval.data_dir", "eval.output_dir")


def unmounted_paths(cfg: Config, mounts: list[str]) -> list[str]:
    """Absolute paths of the config that no container mount provides (`key=path` strings).

    Found before submission, a forgotten `--mount` costs a warning instead of a queue wait and a failed job.
    """
    targets = [m.split(":")[1].rstrip("/") for m in mounts if m.count(":") >= 1]
    missing = []
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not (isinstance(value, str) and value.startswith("/")):
            continue
        if not any(value == t or value.startswith(t + "/") for t in targets):
            missing.append(f"{key}={value}")
    return missing


def job_name(subcommand: str, recipe_path: Path) -> str:
    return f"{subcommand}_{recipe_path.stem}".replace(".", "_")


def eval_cli_args(cfg: Config) -> list[str]:
    """`megatron-rlvr eval` takes flags, not a config file: the recipe's eval, rollout and reward knobs as flags."""
    e = cfg.eval
    if not e.benchmarks:
        raise ConfigError("eval.benchmarks: empty; name at least one benchmark, e.g. eval.benchmarks=[math500]")
    args = [
        "eval",
        "--model",
        cfg.model.hf_dir,
        "--benchmarks",
        *e.benchmarks,
        "--data-dir",
        e.data_dir,
        "--n",
        str(e.n_samples),
        "--chunk",
        str(e.chunk),
        "--out",
        e.output_dir,
        "--temperature",
        str(e.temperature),
        "--top-p",
        str(e.top_p),
        "--dtype",
        e.dtype,
        "--max-new-tokens",
        str(e.max_new_tokens),
        "--seed",
        str(e.seed),
        "--limit",
        str(e.limit),
        "--max-model-len",
        str(cfg.rollout.max_model_len),
        "--tp",
        str(cfg.rollout.tp),
        "--workers",
        str(cfg.reward.workers),
    ]
    if e.stop:
        args += ["--stop", *e.stop]
    if e.chat_template:
        args.append("--chat-template")
    if e.system_prompt is not None:
        args += ["--system-prompt", e.system_prompt]
    if cfg.reward.answer != "tagged":
        args += ["--answer", cfg.reward.answer]
    if not e.save_text:
        args.append("--no-text")
    return args


def check_plan(recipe: str, overrides: list[str], cfg: Config, nodes: int, gpus_per_node: int, force: bool) -> int:
    """`megatron-rlvr plan` before a cluster job is queued: one line on stderr; 3 (the plan's exit status) when the
    layout cannot fit on the H200s and `--force` was not given, else 0. A job that would run out of memory costs
    a queue wait on several nodes before it fails; the plan costs milliseconds here."""
    import sys

    from megatron_rlvr.plan.command import EXIT_DOES_NOT_FIT, H200_MEMORY_GB, make_plan

    hf = find_hf_config(cfg.model.hf_dir)
    if hf is None:
        print(
            f"[plan] warning: no config.json for model.hf_dir={cfg.model.hf_dir}: memory not planned", file=sys.stderr
        )
        return 0
    plan = make_plan(cfg, hf, nodes, gpus_per_node, H200_MEMORY_GB)
    where = f"{plan.worst.name}, {plan.worst.peak_phase}"
    line = f"peak {plan.peak / 1e9:.1f} GB per GPU ({where}) of {H200_MEMORY_GB:g} GB"
    if plan.fits:
        print(f"[plan] {line}: fits", file=sys.stderr)
        return 0
    breaker = plan.breaker()
    why = "; ".join(plan.problems) or f"largest part: {breaker[0]} {breaker[1] / 1e9:.1f} GB"
    detail = f"megatron-rlvr plan {recipe} {' '.join(overrides)} --nodes {nodes}".replace("  ", " ")
    if force:
        print(f"[plan] warning: {line}: does not fit ({why}); queued anyway (--force)", file=sys.stderr)
        return 0
    print(
        f"error: the memory plan does not fit: {line} ({why}); see `{detail}` and its --suggest, or give --force "
        f"to queue anyway",
        file=sys.stderr,
    )
    return EXIT_DOES_NOT_FIT


def recipe_job_main(subcommand: str, argv: list[str] | None, description: str) -> int:
    """The whole of `launch/train.py` and `launch/eval.py`: parse, validate, run.

    Overrides are validated here, through `load_config` and `Config.validate` with the job's world size, because
    nemo-run would accept a bad one and fail only on the cluster. Training gets the resolved config as a file
    shipped with the job; evaluation gets it as `megatron-rlvr eval` flags, on one node with one process per GPU of
    its single vLLM engine (vLLM's external launcher: world size = rollout.tp).
    """
    import argparse
    import sys

    from launch.executors import file_placeholder, run_task
    from launch.options import LaunchError, add_launch_arguments, options_from_args

    parser = argparse.ArgumentParser(prog=f"launch/{subcommand}.py", description=description)
    parser.add_argument(
        "--recipe", required=True, help=f"name in configs/ or a YAML path; known: {', '.join(recipe_names())}"
    )
    add_launch_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. algo.loss.alpha=0.05")
    if subcommand == "train":
        parser.add_argument(
            "--force",
            action="store_true",
            help="queue the job even when the memory plan says it does not fit on its GPUs",
        )
    args = parser.parse_args(argv)
    try:
        if subcommand == "eval":
            cfg = load_config(find_recipe(args.recipe), args.overrides)
            if args.nproc_per_node is None:
                args.nproc_per_node = cfg.rollout.tp if args.executor == "slurm_h200" else 1
            # slurm_local: one engine replica per node (rollout.tp=1), the replicas split the problems
            if args.nodes != 1 and args.executor != "slurm_local":
                raise LaunchError(f"--nodes {args.nodes}: megatron-rlvr eval runs one vLLM engine; use --nodes 1")
        opts = options_from_args(args)
        path, cfg = load_and_validate(args.recipe, args.overrides, world_size=opts.world_size)
        if subcommand == "eval" and opts.executor == "slurm_h200" and opts.world_size != cfg.rollout.tp:
            raise LaunchError(
                f"--nproc-per-node {opts.procs_per_node}: the eval engine's ranks are its "
                f"rollout.tp={cfg.rollout.tp} GPUs; give --nproc-per-node {cfg.rollout.tp}"
            )
        if subcommand == "eval":
            check_engine_layout(cfg, opts.world_size)
        cli_args = eval_cli_args(cfg) if subcommand == "eval" else [subcommand, file_placeholder("run_config.yaml")]
        if opts.executor != "slurm_h200":  # its paths are the container's; these jobs read this machine's
            try:
                check_local_inputs(subcommand, cfg)
            except UserError as e:
                if not opts.dryrun:
                    raise
                print(f"[launch] dry run: warning: the job would stop at once: {e}", file=sys.stderr)
    except (UserError, ValueError) as e:  # LaunchError, ConfigError, and range errors from section __post_init__
        print(f"error: {e}", file=sys.stderr)
        return 2
    if subcommand == "train" and opts.executor == "slurm_h200":
        status = check_plan(args.recipe, args.overrides, cfg, opts.nodes, opts.procs_per_node, args.force)
        if status:
            return status
    if opts.executor == "slurm_h200":
        for item in unmounted_paths(cfg, opts.mounts):
            print(f"[launch] warning: {item} is under no --mount; the container must provide it", file=sys.stderr)
    ship = {} if subcommand == "eval" else {"run_config.yaml": resolved_yaml(path, cfg, args.overrides)}
    # an eval of one process runs without torchrun: nothing to rendezvous, and the engine builds its own world
    launcher = None if subcommand == "eval" and opts.world_size == 1 else "torchrun"
    return run_task(job_name(subcommand, path), cli_args, opts, ship=ship, launcher=launcher)
