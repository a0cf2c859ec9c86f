"""Stage 2 of the GPU check: MegatronActor on one rank -- the statistics pass and two CaSP updates with the fused op,
right-padded and packed -- on a random Qwen2 made on the spot.

Two modes:
  compare     (the small model, on the CPU or on CUDA): a fresh actor per (dtype, layout) runs the statistics pass,
              two updates and the statistics pass again; figures and per-token log-probs go to --out / --tensors,
              and compare.py holds a CUDA run against a CPU run of the same seeds. With --kl-coef the actor keeps a
              KL reference (a frozen copy; with --lora-rank, the base with the adapters off), scored before the
              updates and again after them (a frozen model must not move).
  throughput  (the ~1B model, bf16, CUDA): one actor; a warm-up update, then per layout the statistics pass (all on
              the same weights, compared with each other: packing changes no number beyond rounding) and two
              updates from fresh statistics, each timed (tokens/s over the batch's real tokens, and the model FLOP
              utilisation at 6 x params FLOPs per token) with its peak memory.

--core-attention picks the local spec's attention (models/builder.py: auto, sdpa, unfused).

    python tools/gpu_check/actor_check.py --model small --mode compare --out /tmp/a.json --tensors /tmp/a.pt
    python tools/gpu_check/actor_check.py --model 1b --mode throughput --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import resource
import sys
from pathlib import Path
from typing import Any

from megatron_rlvr.testing.configs import algo_config

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (after the path: the scripts run from a plain checkout)

LAYOUTS = {
    # name -> ActorConfig fields; micro-batches of micro_batch_size sequences unless a token budget is given
    "padded": dict(pack_sequences=False),
    "packed": dict(pack_sequences=True),
    "packed_budget": dict(pack_sequences=True, max_tokens_per_micro_batch=-1),  # -1: micro_batch_size x max length
}
PACKING_FIELDS = ("pack_sequences", "max_tokens_per_micro_batch")
# dense bf16 tensor-core peak of an H100 / H200 SXM (NVIDIA's datasheets), TFLOP/s: the MFU's denominator
DEFAULT_PEAK_TFLOPS = 989.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(common.MODELS), default="small")
    p.add_argument("--mode", choices=["compare", "throughput"], default="compare")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="what the run must be on (the device is torch's: hide the GPU with CUDA_VISIBLE_DEVICES=)",
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="compare mode: one fresh actor per dtype and layout")
    p.add_argument("--layouts", default="padded,packed", help=f"comma list of {sorted(LAYOUTS)}")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--min-response", type=int, default=8)
    p.add_argument("--max-response", type=int, default=112)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="updates (one optimizer step each)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK, help="where the random model is written")
    p.add_argument("--out", type=Path, required=True, help="the stage's JSON")
    p.add_argument("--tensors", type=Path, default=None, help="compare mode: per-token log-probs (torch.save)")
    p.add_argument("--core-attention", choices=["auto", "sdpa", "unfused"], default="auto")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on a frozen base (0: none)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a KL term, so the actor keeps a reference")
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="throughput: the MFU's peak")
    p.add_argument(
        "--no-reduced-precision-bf16",
        action="store_true",
        help="cuBLAS sums bf16 products in fp32 (torch allows reduced precision by default): does CUDA's bf16 then "
        "drift from fp32 as little as the CPU's? (docs/gpu-check.md)",
    )
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    layouts = [x for x in args.layouts.split(",") if x]
    dtypes = [x for x in args.dtypes.split(",") if x]
    errors = [f"--layouts: unknown {x!r}; expected {sorted(LAYOUTS)}" for x in layouts if x not in LAYOUTS]
    errors += [
        f"--dtypes: unknown {x!r}; expected float32, bfloat16" for x in dtypes if x not in ("float32", "bfloat16")
    ]
    if not layouts or not dtypes:
        errors.append("--layouts and --dtypes need at least one entry each")
    if args.min_response < 1 or args.max_response < args.min_response:
        errors.append(f"--min-response {args.min_response} / --max-response {args.max_response}: need 1 <= min <= max")
    if args.sequences < 1 or args.micro_batch_size < 1 or args.steps < 1 or args.prompt_len < 1:
        errors.append("--sequences, --micro-batch-size, --steps and --prompt-len must be >= 1")
    if args.mode == "compare" and args.tensors is None:
        errors.append("--mode compare needs --tensors")
    if args.lora_rank < 0 or args.kl_coef < 0 or args.peak_tflops <= 0:
        errors.append("--lora-rank and --kl-coef must be >= 0, --peak-tflops > 0")
    return errors


def preflight(args: argparse.Namespace) -> list[str]:
    """What the dry run checks without a GPU: the arguments, the imports, and the ActorConfig fields it sets.
    Returns notes for the dry run; raises SystemExit on an error."""
    errors = check_args(args)
    if errors:
        raise SystemExit("actor_check: " + "; ".join(errors))
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch  # noqa: F401

    from megatron_rlvr.actor.config import ActorConfig, LoraConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor  # noqa: F401
    from megatron_rlvr.models.builder import attention_choice  # noqa: F401
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.ops import backends  # noqa: F401
    from megatron_rlvr.protocols import Statistics, Targets  # noqa: F401
    from megatron_rlvr.testing.handoffs import rollouts  # noqa: F401
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_config, write_random_hf_checkpoint  # noqa: F401

    algo_config({"loss.kind": "casp", "kl.coef": args.kl_coef})
    if args.lora_rank:
        LoraConfig(rank=args.lora_rank)
    missing = [f for f in PACKING_FIELDS if f not in {f.name for f in dataclasses.fields(ActorConfig)}]
    if missing:
        raise SystemExit(
            f"actor_check: ActorConfig has no {missing}; the check sets them to run the actor padded and packed"
        )
    ModelConfig(hf_dir="", core_attention=args.core_attention)
    return []


# ---------------------------------------------------------------------------------------------------------------


def make_batch(vocab: int, args: argparse.Namespace):
    """(right-padded rollouts: a prompt, then a response of random length; their targets: advantages of both
    signs)."""
    import torch

    from megatron_rlvr.protocols import Targets
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(args.seed)
    b, s = args.sequences, args.prompt_len + args.max_response
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.randint(args.min_response, args.max_response + 1, (b,), generator=g)
    mask = torch.zeros(b, s - 1, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, args.prompt_len - 1 : args.prompt_len - 1 + n] = True  # position t marks token t + 1
        tokens[i, args.prompt_len + n :] = 0
    return rollouts(tokens, mask), Targets(advantages=torch.randn(b, generator=g))


def real_tokens(batch) -> int:
    """Tokens up to each sequence's last response token (what packing keeps; the rest is padding)."""
    import torch

    width = batch.response_mask.shape[1]
    last = torch.where(batch.response_mask, torch.arange(1, width + 1), 0).amax(dim=1)
    return int((last + 1).sum())


def actor_config(args: argparse.Namespace, layout: str, bf16: bool):
    from megatron_rlvr.actor.config import ActorConfig, LoraConfig

    extra = dict(LAYOUTS[layout])
    if extra.get("max_tokens_per_micro_batch") == -1:
        extra["max_tokens_per_micro_batch"] = args.micro_batch_size * (args.prompt_len + args.max_response)
    lora = LoraConfig(rank=args.lora_rank) if args.lora_rank else None
    return ActorConfig(micro_batch_size=args.micro_batch_size, lr=args.lr, bf16=bf16, lora=lora, **extra)


def set_layout(actor, args: argparse.Namespace, layout: str) -> None:
    """Switch a built actor's micro-batching (read at every pass) to ``layout``."""
    cfg = actor_config(args, layout, actor.cfg.bf16)
    for key in PACKING_FIELDS:
        setattr(actor.cfg, key, getattr(cfg, key))


def peak_bytes(cuda: bool) -> int:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak RSS


def reset_peak(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def build_actor(hf_dir: Path, args: argparse.Namespace, layout: str, bf16: bool, total_steps: int):
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig

    return MegatronActor(
        ModelConfig(hf_dir=str(hf_dir), core_attention=args.core_attention),
        actor_config(args, layout, bf16),
        algo_config({"loss.kind": "casp", "kl.coef": args.kl_coef}),
        temperature=1.0,
        total_steps=total_steps,
    )


def _update_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The update's loss, gradient norm and non-finite flag, and every term of the loss (its KL among them)."""
    keep = ("actor/loss", "actor/grad_norm", "actor/nonfinite")
    return {k: float(v) for k, v in metrics.items() if k in keep or k.startswith("loss/")}


def compare_mode(args: argparse.Namespace, hf_dir: Path, cuda: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh actor per (dtype, layout): statistics, ``steps`` updates, statistics again."""
    import torch

    from megatron_rlvr.ops import backends
    from megatron_rlvr.protocols import Statistics
    from megatron_rlvr.runtime.distributed import model_parallel

    runs: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    tokens = 0
    for dtype in args.dtypes.split(","):
        for layout in args.layouts.split(","):
            key = f"{dtype}/{layout}"
            with model_parallel(tp=1, pp=1, seed=args.seed):
                actor = build_actor(hf_dir, args, layout, bf16=dtype == "bfloat16", total_steps=args.steps)
                batch, targets = make_batch(actor.vocab_size, args)
                tokens = real_tokens(batch)
                timer = common.Timer(cuda)
                with timer:
                    old = actor.compute_old_logp(batch)
                run: dict[str, Any] = {"status": "ok", "stats_pass_s": round(timer.seconds, 4), "updates": []}
                statistics = Statistics(old_logp=old)
                mask = batch.response_mask
                if actor.has_reference:
                    statistics = Statistics(old_logp=old, ref_logp=actor.compute_ref_logp(batch))
                    run["reference"] = "the base, adapters off" if args.lora_rank else "a frozen copy"
                for _ in range(args.steps):
                    with timer:
                        metrics = actor.update(batch, targets, statistics, mini_batches=1)
                    run["updates"].append(_update_figures(metrics) | {"seconds": round(timer.seconds, 4)})
                after = actor.compute_old_logp(batch)
                run["logp_mean_before"] = float(old[mask].mean())
                run["logp_mean_after"] = float(after[mask].mean())
                run["impl"] = backends.resolve(torch.device("cuda" if cuda else "cpu"), None, 3)
                tensors[key] = {"before": old[mask].float().cpu(), "after": after[mask].float().cpu()}
                if actor.has_reference:  # scored again after the updates: a frozen model gives the same numbers
                    ref_after = actor.compute_ref_logp(batch)
                    run["ref_moved_max_abs"] = float((ref_after - statistics.ref_logp)[mask].abs().max())
                    tensors[key]["ref"] = statistics.ref_logp[mask].float().cpu()
                runs[key] = run
                del actor
                gc.collect()
    return {"runs": runs, "real_tokens": tokens}, tensors


def throughput_mode(args: argparse.Namespace, hf_dir: Path, cuda: bool, save) -> dict[str, Any]:
    """One bf16 actor: a warm-up update, then per layout the statistics pass and ``steps`` timed updates. ``save(out)``
    writes the figures so far after each phase: a stage stopped at its time limit still leaves them."""
    import torch

    from megatron_rlvr.ops import backends
    from megatron_rlvr.runtime.distributed import model_parallel

    out: dict[str, Any] = {"layouts": {}, "complete": False}
    layouts = args.layouts.split(",")
    with model_parallel(tp=1, pp=1, seed=args.seed):
        reset_peak(cuda)
        timer = common.Timer(cuda)
        with timer:
            actor = build_actor(hf_dir, args, "padded", bf16=True, total_steps=1 + args.steps * len(layouts))
        out |= {
            "build_s": round(timer.seconds, 2),
            "build_peak_gib": round(peak_bytes(cuda) / 2**30, 2),
            "impl": backends.resolve(torch.device("cuda" if cuda else "cpu"), None, 3),
        }
        batch, targets = make_batch(actor.vocab_size, args)
        tokens = real_tokens(batch)
        out |= {
            "real_tokens": tokens,
            "padded_tokens": int(batch.tokens.numel()),
            "sequences": len(batch),
            "max_len": int(batch.tokens.shape[1]),
        }
        statistics = actor.statistics_pass(batch)  # warms up the kernels and the allocator
        with timer:
            actor.update(batch, targets, statistics, mini_batches=1)  # allocates the optimizer's state
        out["warmup_update_s"] = round(timer.seconds, 3)
        save(out)
        stats: dict[str, Any] = {}
        for layout in layouts:  # statistics first, so every layout sees the same weights
            set_layout(actor, args, layout)
            reset_peak(cuda)
            with timer:
                stats[layout] = actor.compute_old_logp(batch)
            out["layouts"][layout] = {
                "status": "ok",
                "stats_pass_s": round(timer.seconds, 4),
                "stats_tokens_per_s": round(tokens / timer.seconds),
                "stats_peak_gib": round(peak_bytes(cuda) / 2**30, 2),
            }
            save(out)
        mask = batch.response_mask
        first = next(iter(stats), None)
        for layout, logp in stats.items():
            out["layouts"][layout]["logp_max_abs_diff_vs_" + first] = float((logp - stats[first])[mask].abs().max())
        for layout in stats:
            set_layout(actor, args, layout)
            statistics = actor.statistics_pass(batch)  # the weights moved: each layout starts on-policy
            fig = out["layouts"][layout]
            fig["updates"] = []
            reset_peak(cuda)
            for _ in range(args.steps):
                with timer:
                    metrics = actor.update(batch, targets, statistics, mini_batches=1)
                flops = 6 * common.param_count(common.MODELS[args.model]) * tokens / timer.seconds
                fig["updates"].append(
                    _update_figures(metrics)
                    | {
                        "seconds": round(timer.seconds, 4),
                        "tokens_per_s": round(tokens / timer.seconds),
                        "tflops": round(flops / 1e12, 1),
                        "mfu": round(flops / (args.peak_tflops * 1e12), 4),
                    }
                )
            fig["update_peak_gib"] = round(peak_bytes(cuda) / 2**30, 2)
            save(out)
    out["complete"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    preflight(args)
    import torch

    cuda = torch.cuda.is_available()
    if args.device != "auto" and (args.device == "cuda") != cuda:
        raise SystemExit(f"actor_check: --device {args.device} but torch.cuda.is_available() is {cuda}")
    if args.no_reduced_precision_bf16:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    backend = common.init_process_group()
    result: dict[str, Any] = {
        "env": common.environment(),
        "backend": backend,
        "model": args.model,
        "params": common.param_count(common.MODELS[args.model]),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    from megatron_rlvr.models.builder import attention_choice, transformer_engine_available

    result["transformer_engine"] = transformer_engine_available()
    result["attention"] = attention_choice(result["transformer_engine"], args.core_attention, cuda=cuda)
    result["peak_tflops"] = args.peak_tflops
    timer = common.Timer(False)
    with timer:
        hf_dir = common.model_dir(args.model, args.work)
    result["model_dir_s"] = round(timer.seconds, 2)
    if args.mode == "compare":
        figures, tensors = compare_mode(args, hf_dir, cuda)
        torch.save(tensors, args.tensors)
        result |= figures | {"tensors": str(args.tensors)}
    else:
        result |= throughput_mode(args, hf_dir, cuda, save=lambda part: common.write_json(args.out, result | part))
    common.write_json(args.out, result)
    print(f"actor_check: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
