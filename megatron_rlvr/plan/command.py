"""`megatron-rlvr plan RECIPE [key=value ...] [--nodes N] [--gpu-memory-gb 141] [--host-memory-gb G] [--json]
[--suggest]`.

Prints, per GPU, the bytes of each component of the recipe's layout and the peak of each phase (rollout,
statistics, update, sync), then the host memory of the fullest node (plan/host_memory.py) against
``cluster.host_memory_gb``, and whether both fit. Exit status: 0 fits, 3 does not fit (GPU or host), 2 bad recipe or
argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megatron_rlvr.errors import UserError
from megatron_rlvr.models.builder import ATTENTION_NAMES
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.host_memory import host_json, host_plan, host_text
from megatron_rlvr.plan.memory import ESTIMATED_PARTS, GB, PHASE_PARTS, Layout, Plan, plan_layout
from megatron_rlvr.plan.stage_params import stage_params
from megatron_rlvr.plan.suggest import RANKING_RULE, suggest

EXIT_FITS, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 2, 3
H200_MEMORY_GB = 141.0

LABELS = {
    "actor_weights": "actor weights",
    "adapters": "LoRA adapters",
    "actor_grads": "main grads (fp32)",
    "optimizer": "optimizer state",
    "reference": "frozen reference",
    "activations": "activations (update)",
    "backward_working": "backward working set",
    "forward_working": "no-grad pass working set",
    "logits": "logits shard (fused op)",
    "op_scratch": "fused op records",
    "teacher_scores": "teacher's gathered scores",
    "dispatcher": "MoE dispatcher buffers",
    "cp_kv": "CP-gathered K/V (1 layer)",
    "engine_weights": "engine weights",
    "kv_cache": "engine KV cache",
    "engine_workspace": "engine workspace",
    "sync_buckets": "weight-sync buckets",
    "runtime": "CUDA context + NCCL",
}


def load_plan_inputs(recipe: str, overrides: list[str], nodes: int | None, gpus_per_node: int):
    """(config, HF config, nodes): the recipe with overrides, validated at its world size; nodes default to the
    recipe header's `--nodes N`, else 1."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.errors import ConfigError
    from megatron_rlvr.plan.recipe_files import documented_nodes, find_hf_config, find_recipe

    path = find_recipe(recipe)
    cfg = load_config(path, overrides)
    nodes = nodes if nodes is not None else documented_nodes(path) or 1
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be >= 1")
    hf = find_hf_config(cfg.model.hf_dir)
    if hf is None:
        raise ConfigError(
            f"model.hf_dir={cfg.model.hf_dir!r}: no config.json there or in configs/models/; the plan "
            f"needs the model's shapes"
        )
    validate_model(cfg, hf)
    cfg.validate(world_size=nodes * gpus_per_node, dims=ModelDims.from_hf(hf))
    return cfg, hf, nodes


def validate_model(cfg: Any, hf: dict) -> None:
    """The family's own checks of the config.json (the trainer's, before it builds the model): an architecture
    the project does not read, or an MoE field it would not build (another router, shared experts), is refused
    here too, naming the field."""
    from megatron_rlvr.models.hf_config import family_of
    from megatron_rlvr.plan.recipe_files import hf_config_path

    where = f"{hf_config_path(cfg.model.hf_dir)} (model.hf_dir={cfg.model.hf_dir!r})"
    family_of(hf, where).validate(hf, where)


def make_plan(
    cfg: Any,
    hf: dict,
    nodes: int,
    gpus_per_node: int = 8,
    gpu_memory_gb: float = H200_MEMORY_GB,
    headroom_gb: float | None = None,
) -> Plan:
    try:
        dims = ModelDims.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"model.hf_dir={cfg.model.hf_dir!r}: config.json lacks a usable shape ({e})") from e
    return plan_layout(dims, Layout.from_config(cfg, nodes * gpus_per_node), gpu_memory_gb, headroom_gb)


def _gb(value: int) -> float:
    return round(value / GB, 2)


def plan_json(plan: Plan, recipe: str, nodes: int, gpus_per_node: int) -> dict[str, Any]:
    """One object: fits, peak_gb, phases (of the rank with the highest peak), components (name_gb -> GB, of that
    rank), every rank kind, the layout and the problems."""
    worst = plan.worst
    breaker = plan.breaker()
    return {
        "recipe": recipe,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "gpu_memory_gb": plan.gpu_memory / GB,
        "fits": plan.fits,
        "peak_gb": _gb(plan.peak),
        "headroom_gb": _gb(plan.headroom),
        "peak_phase": worst.peak_phase,
        "peak_rank": worst.name,
        "phases": {k: _gb(v) for k, v in worst.phases.items()},
        "components": {f"{k}_gb": _gb(v) for k, v in worst.components.items()},
        "estimated_components": list(ESTIMATED_PARTS) if plan.layout.gpu else [],
        "ranks": [
            {
                "name": r.name,
                "peak_gb": _gb(r.peak),
                "phases": {k: _gb(v) for k, v in r.phases.items()},
                "components": {f"{k}_gb": _gb(v) for k, v in r.components.items()},
            }
            for r in plan.ranks
        ],
        "breaking_component": None if breaker is None else {"name": breaker[0], "gb": _gb(breaker[1])},
        "problems": plan.problems,
        "notes": plan.notes,
        "layout": dict(vars(plan.layout)),
    }


def describe_layout(lay: Layout) -> str:
    parts = [
        f"actor TP={lay.tp} PP={lay.pp}"
        + (f" VPP={lay.vpp}" if lay.vpp else "")
        + (f" CP={lay.cp}" if lay.cp > 1 else "")
        + (f" EP={lay.ep} ETP={lay.etp}" if lay.ep > 1 or lay.etp > 1 else "")
        + f" DP={lay.dp}",
        "sequence parallel" if lay.sequence_parallel else "no sequence parallel",
        f"{lay.recompute} recompute",
        "distributed optimizer" if lay.distributed_optimizer else "local optimizer",
        "bf16" if lay.param_bytes == 2 else "fp32",
        f"{lay.micro_tokens} tokens per micro-batch" + (" per CP rank" if lay.cp > 1 else ""),
    ]
    parts.append(f"attention: {ATTENTION_NAMES[lay.attention_kind]}")
    if lay.reference:
        parts.append("frozen reference")
    if lay.lora_rank:
        parts.append(f"LoRA rank {lay.lora_rank} (base frozen, free reference, sync {lay.lora_sync})")
    engine = (
        (
            f"engines colocated, TP={lay.engine_tp}, gpu_memory_utilization={lay.gpu_memory_utilization}, sleep "
            f"level {lay.sleep_level}"
        )
        if lay.placement != "separate"
        else (
            f"engines on {lay.engine_ranks} separate ranks, TP={lay.engine_tp}, "
            f"gpu_memory_utilization={lay.gpu_memory_utilization}"
        )
    )
    return ", ".join(parts) + "; " + engine


def _billions(count: int) -> str:
    """A parameter count in units of 1e9 to four significant digits: 32.76e9, and 0.1345e9 for a 135M model."""
    return f"{count / 1e9:.4g}e9"


def moe_summary(dims: ModelDims) -> str:
    return (
        f"; {_billions(dims.active_params())} active per token ({dims.experts} experts, top-{dims.experts_per_token})"
    )


def plan_text(plan: Plan, recipe: str, nodes: int, gpus_per_node: int, dims: ModelDims) -> str:
    lay = plan.layout
    phases = list(PHASE_PARTS)
    lines = [
        f"plan: {recipe} on {nodes} node(s) x {gpus_per_node} GPUs of {plan.gpu_memory / GB:g} GB",
        f"layout: {describe_layout(lay)}",
        f"model: {_billions(dims.hf_params())} parameters; per actor rank "
        + ", ".join(
            f"stage {s}: {_billions(stage_params(dims, lay.tp, lay.pp, s, lay.divisible_by, lay.ep, lay.etp))}"
            for s in range(lay.pp)
        )
        + (moe_summary(dims) if dims.is_moe else ""),
        "",
    ]
    for rank in plan.ranks:
        rank_phases = [p for p in phases if p in rank.phases]
        lines.append(f"{'per GPU, ' + rank.name:<34}{'GB':>8}  " + "".join(f"{p:>11}" for p in rank_phases))
        for name, value in rank.components.items():
            if value == 0:
                continue
            marks = "".join(
                f"{'x' if name in PHASE_PARTS.get(p, ()) or rank.name == 'engine rank' else '':>11}"
                for p in rank_phases
            )
            label = LABELS.get(name, name) + (" (estimate)" if name in ESTIMATED_PARTS else "")
            lines.append(f"  {label:<32}{value / GB:>8.2f}  {marks}")
        lines.append(f"  {'phase total':<32}{'':>8}  " + "".join(f"{rank.phases[p] / GB:>11.1f}" for p in rank_phases))
        lines.append("")
    c = plan.worst.components
    if lay.placement != "separate" and lay.gpu and c.get("engine_weights"):
        where = "moved to host memory" if lay.sleep_level == 1 else "dropped (re-sent at sync)"
        lines.append(
            f"sleep mode frees {(c['engine_weights'] + c['kv_cache']) / GB:.1f} GB during statistics and "
            f"update: the engine weights ({c['engine_weights'] / GB:.1f} GB, {where}) and the KV cache "
            f"({c['kv_cache'] / GB:.1f} GB); the workspace ({c['engine_workspace'] / GB:.1f} GB) stays."
        )
    for note in plan.notes:
        lines.append(f"note: {note}")
    for problem in plan.problems:
        lines.append(f"problem: {problem}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"peak {plan.peak / GB:.1f} GB per GPU ({plan.worst.name}, {plan.worst.peak_phase}) of "
        f"{plan.gpu_memory / GB:g} GB, {plan.headroom / GB:.1f} GB kept free: {verdict}"
    )
    breaker = plan.breaker()
    if breaker is not None and plan.over > 0:
        lines.append(
            f"breaks it: {breaker[0]} ({LABELS.get(breaker[0], breaker[0])}) {breaker[1] / GB:.1f} GB, the "
            f"largest part of the {plan.worst.peak_phase} phase, which is {plan.over / GB:.1f} GB over; "
            f"try --suggest"
        )
    if lay.gpu:
        lines.extend(MEASURED_NOTE)
    return "\n".join(lines)


# What a GPU plan's verdict rests on (docs/plan.md, "What 'fits' rests on").
MEASURED_NOTE = (
    "(estimate): a guess for the GPU, not measured; the engine's total is its gpu_memory_utilization budget either way.",
    "the verdict is arithmetic: the actor's parts are checked against a real actor on CPU (fp32), but nothing in this",
    "plan was measured on a GPU (bf16 bytes, the vLLM engine, the CUDA context): docs/plan.md",
)


def header_lines(plan: Plan) -> list[str]:
    """The plan in a recipe header's few lines (tests/integration/configs check every GPU recipe carries its current plan)."""
    lay, c = plan.layout, plan.worst.components

    def gb(key: str) -> str:
        return f"{c[key] / GB:.1f}"

    parallel = f"actor TP={lay.tp} PP={lay.pp}" + (f" CP={lay.cp}" if lay.cp > 1 else "")
    parallel += f" EP={lay.ep}" if lay.ep > 1 else ""
    actor = (
        f"{parallel} DP={lay.dp}: weights {gb('actor_weights')} GB, main grads "
        f"{gb('actor_grads')}, optimizer {gb('optimizer')}, activations {gb('activations')}, "
        f"logits {gb('logits')}"
    )
    if lay.reference:
        actor += f", reference {gb('reference')}"
    if lay.lora_rank:
        actor += f", LoRA adapters {gb('adapters')}"
    if c.get("dispatcher"):
        actor += f", dispatcher {gb('dispatcher')}"
    if c.get("cp_kv"):
        actor += f", CP K/V {gb('cp_kv')}"
    engine = (
        f"engine TP={lay.engine_tp} at gpu_memory_utilization {lay.gpu_memory_utilization}: weights "
        f"{gb('engine_weights')} GB, KV cache {gb('kv_cache')}, workspace {gb('engine_workspace')} (kept asleep)"
    )
    phases = ", ".join(f"{k} {v / GB:.1f}" for k, v in plan.worst.phases.items())
    verdict = "fits" if plan.fits else "does NOT fit"
    return [actor + ";", engine + ";", f"phases (GB): {phases} => peak {plan.peak / GB:.1f} GB: {verdict}"]


def suggestions_text(rows, has_token_budget: bool, top: int) -> str:
    if not rows:
        return "no layout fits on these nodes"
    lines = [
        f"{len(rows)} layouts fit; best first by: {RANKING_RULE}",
        f"{'TP':>3} {'PP':>3} {'CP':>3} {'EP':>3} {'DP':>3} {'micro tok':>10} {'eng TP':>7} {'util':>5} {'peak GB':>8}"
        f" {'KV GB':>6}"
        f" {'seq slots':>9}  overrides",
    ]
    for s in rows[:top]:
        lay, c = s.layout, s.plan.ranks[0].components
        lines.append(
            f"{lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.ep:>3} {lay.dp:>3} {lay.micro_tokens:>10} {lay.engine_tp:>7} "
            f"{lay.gpu_memory_utilization:>5.2f} {s.plan.peak / GB:>8.1f} {c['kv_cache'] / GB:>6.1f} "
            f"{s.sequence_slots:>9}  " + " ".join(s.overrides(has_token_budget))
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-rlvr plan",
        description=__doc__.split("\n\n")[1],
        epilog="Exit status: 0 fits, 3 does not fit, 2 bad recipe or argument.",
    )
    p.add_argument("recipe", help="a recipe name in configs/ or a YAML path")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. actor.tp=4")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe header's --nodes, else 1)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, default=H200_MEMORY_GB, help="memory of one GPU (H200: 141)")
    p.add_argument(
        "--headroom-gb",
        type=float,
        default=None,
        help="memory each GPU keeps free for allocator fragmentation (default: 5%% of --gpu-memory-gb)",
    )
    p.add_argument(
        "--host-memory-gb",
        type=float,
        default=None,
        help="host memory of one node (default: the recipe's cluster.host_memory_gb)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--suggest", action="store_true", help="list the layouts that fit on these nodes, best first")
    p.add_argument("--top", type=int, default=10, help="--suggest: how many layouts to print")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, hf, nodes = load_plan_inputs(args.recipe, args.overrides, args.nodes, args.gpus_per_node)
        if args.gpu_memory_gb <= 0:
            raise UserError(f"--gpu-memory-gb {args.gpu_memory_gb}: must be > 0")
        if args.host_memory_gb is not None and args.host_memory_gb < 0:
            raise UserError(f"--host-memory-gb {args.host_memory_gb}: must be >= 0 (0: not checked)")
        if args.headroom_gb is not None and not 0 <= args.headroom_gb < args.gpu_memory_gb:
            raise UserError(f"--headroom-gb {args.headroom_gb}: must be in [0, --gpu-memory-gb)")
        plan = make_plan(cfg, hf, nodes, args.gpus_per_node, args.gpu_memory_gb, args.headroom_gb)
    except (UserError, ValueError) as e:  # ConfigError, and range errors of a section's __post_init__
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dims = ModelDims.from_hf(hf)
    if args.suggest:
        rows = suggest(
            dims, plan.layout, nodes * args.gpus_per_node, args.gpus_per_node, args.gpu_memory_gb, args.headroom_gb
        )
        has_budget = hasattr(cfg.actor, "max_tokens_per_micro_batch")
        if args.json:
            print(
                json.dumps(
                    [
                        {
                            "overrides": s.overrides(has_budget),
                            "peak_gb": _gb(s.plan.peak),
                            "kv_cache_gb": _gb(s.plan.ranks[0].components["kv_cache"]),
                            "sequence_slots": s.sequence_slots,
                        }
                        for s in rows[: args.top]
                    ]
                )
            )
        else:
            print(suggestions_text(rows, has_budget, args.top))
        return EXIT_FITS if rows else EXIT_DOES_NOT_FIT
    host_gb = cfg.cluster.host_memory_gb if args.host_memory_gb is None else args.host_memory_gb
    host = host_plan(cfg, hf, plan.layout, nodes * args.gpus_per_node, args.gpus_per_node, host_gb)
    if args.json:
        out = plan_json(plan, args.recipe, nodes, args.gpus_per_node)
        out["host"] = host_json(host)
        out["gpu_fits"], out["fits"] = out["fits"], plan.fits and host.fits
        print(json.dumps(out, indent=1))
    else:
        print(plan_text(plan, args.recipe, nodes, args.gpus_per_node, dims))
        print("")
        print(host_text(host))
    return EXIT_FITS if plan.fits and host.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
