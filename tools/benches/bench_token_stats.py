"""Benchmark of the fused token-statistics op against the composite that systems use today and the logsumexp floor.

In ONE run, on every TP rank's logits shard [T, V/tp], side by side (median of repeats; peak extra memory measured
in a separate untimed call):
  floor       torch.logsumexp over the shard (no statistics, no communication: what one pass of exp costs)
  ours        vocab_parallel_token_stats: log-prob, entropy, top-N (forward; forward+backward; in-place backward)
  composite   megatron-core's vocab_parallel_cross_entropy for log-probs + an entropy with three all-reduces
              (max, sum exp, sum p*z) + all-gather of the full vocabulary then top-N of its log-softmax
  --also      other implementations of ours, timed the same way (e.g. the CUDA kernel that is not the default)
Prints a table and, as its last line, one JSON object (fp32 figures at the top level, every dtype under "by_dtype").

    python tools/benches/bench_token_stats.py                  # T=4096, V=151936, TP=2 over gloo, fp32 and bf16
    python tools/benches/bench_token_stats.py --quick          # a smaller shape, under a minute
    python tools/benches/bench_token_stats.py --device cuda --tp 1 --tokens 16384 --also cuda-vector  # the GPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_rlvr.testing.workers import LiveBytes  # noqa: E402 (after the path insert)


@dataclasses.dataclass
class BenchConfig:
    tokens: int = 4096
    vocab: int = 151936
    tp: int = 2
    top_n: int = 3
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    repeats: int = 5
    device: str = "cpu"
    threads_per_rank: int = 1
    also: tuple[str, ...] = ()  # implementations timed beside the default one ("ours")


def figure_prefix(impl: str) -> str:
    """The key prefix of an --also implementation's figures: cuda-vector -> cuda_vector (fwd, fwdbwd, ...)."""
    return impl.replace("-", "_")


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while fn runs (its results included), beyond what existed before."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes() as tracker:
        result = fn()
        del result
    return tracker.peak


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device, setup=None) -> float:
    import torch.distributed as dist

    times = []
    for i in range(repeats + 1):  # the first call warms up
        state = setup() if setup else None
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(state) if setup else fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
        del result, state
    return statistics.median(times)


def composite_stats(shard: torch.Tensor, targets: torch.Tensor, top_n: int):
    """What systems compute today: megatron's vocab-parallel CE, a three-all-reduce entropy, gather-then-top-N."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    # megatron subtracts the max in place from fp32 logits; the clone keeps the shard intact for the rest
    logp = -vocab_parallel_cross_entropy(shard.clone() if shard.dtype == torch.float32 else shard, targets)
    z = shard.float()
    z_max = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp_z = torch.exp(z - z_max)
    sum_exp = reduce_from_tensor_model_parallel_region(exp_z.sum(dim=-1, keepdim=True))
    probs = exp_z / sum_exp
    sum_pz = reduce_from_tensor_model_parallel_region((probs * z).sum(dim=-1, keepdim=True))
    entropy = (z_max + torch.log(sum_exp) - sum_pz).squeeze(-1)
    full = gather_from_tensor_model_parallel_region(shard)
    top = torch.log_softmax(full.float(), dim=-1).topk(top_n, dim=-1)
    return logp, entropy, top.values, top.indices


def _loss(stats) -> torch.Tensor:
    return stats[0].sum() + stats[1].sum() + stats[2].sum()


def bench_rank(cfg: BenchConfig) -> dict:
    """Runs on every TP rank (world size == tp); returns this rank's figures per dtype."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rlvr.ops import backends, vocab_parallel_token_stats
    from megatron_rlvr.runtime import distributed

    distributed.initialize_model_parallel(tp=cfg.tp)
    try:
        device = torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        group = parallel_state.get_tensor_model_parallel_group() if cfg.tp > 1 else None
        rank, vocab_local = parallel_state.get_tensor_model_parallel_rank(), cfg.vocab // cfg.tp
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=gen, device=device)
        impl = backends.resolve(device, None, cfg.top_n)
        also = {figure_prefix(a): backends.resolve(device, a, cfg.top_n) for a in cfg.also}
        out: dict = {
            "impl": impl,
            "also": also,
            "cpu_isa": backends.extension().cpu_isa() if backends.extension() else None,
        }
        for dtype_name in cfg.dtypes:
            dtype = getattr(torch, dtype_name)
            shard = (torch.randn(cfg.tokens, vocab_local, generator=gen, device=device) * 2).to(dtype)
            ours_kw = dict(group=group, vocab_start=rank * vocab_local, vocab_size=cfg.vocab)

            def ours_fwd(implementation=None):
                with torch.no_grad():
                    return vocab_parallel_token_stats(
                        shard, targets, cfg.top_n, implementation=implementation, **ours_kw
                    )

            def ours_fwdbwd(inplace: bool = False, logits=None, implementation=None):
                leaf = (shard if logits is None else logits).detach().requires_grad_()
                stats = vocab_parallel_token_stats(
                    leaf, targets, cfg.top_n, inplace_backward=inplace, implementation=implementation, **ours_kw
                )
                return torch.autograd.grad(_loss(stats), leaf)

            def composite_fwd():
                with torch.no_grad():
                    return composite_stats(shard, targets, cfg.top_n)

            def composite_fwdbwd():
                leaf = shard.detach().requires_grad_()
                return torch.autograd.grad(_loss(composite_stats(leaf, targets, cfg.top_n)), leaf)

            runs = {
                "floor_logsumexp": lambda: torch.logsumexp(shard, dim=-1),
                "ours_fwd": ours_fwd,
                "composite_fwd": composite_fwd,
                "ours_fwdbwd": ours_fwdbwd,
                "composite_fwdbwd": composite_fwdbwd,
            }
            for prefix, name in also.items():
                runs[f"{prefix}_fwd"] = lambda name=name: ours_fwd(name)
                runs[f"{prefix}_fwdbwd"] = lambda name=name: ours_fwdbwd(implementation=name)
            fig = {name: median_seconds(fn, cfg.repeats, device) for name, fn in runs.items()}
            # in place: each repeat needs its own copy of the logits (made outside the timed region)
            for prefix, name in {"ours": None, **also}.items():
                fig[f"{prefix}_fwdbwd_inplace"] = median_seconds(
                    lambda logits, name=name: ours_fwdbwd(True, logits, name),
                    cfg.repeats,
                    device,
                    setup=lambda: shard.clone(),
                )
            logits_bytes = shard.numel() * shard.element_size()
            for name in ("ours_fwd", "composite_fwd", "ours_fwdbwd", "composite_fwdbwd"):
                dist.barrier()
                fig[f"{name}_peak_extra_bytes"] = peak_extra_bytes(runs[name], device)
            inplace_copy = shard.clone()
            dist.barrier()
            fig["ours_fwdbwd_inplace_peak_extra_bytes"] = peak_extra_bytes(
                lambda: ours_fwdbwd(True, inplace_copy), device
            )
            fig["logits_bytes"] = logits_bytes
            out[dtype_name] = fig
            inplace_copy = shard = None  # free this dtype's logits before the next one is drawn
        return out
    finally:
        distributed.destroy_model_parallel()


def summarize(per_rank: list[dict], cfg: BenchConfig) -> dict:
    """Across ranks: the slowest rank's median and the largest peak (a step waits for its slowest rank)."""
    also = per_rank[0]["also"]
    summary: dict = {"impl": per_rank[0]["impl"], "also": also, "cpu_isa": per_rank[0]["cpu_isa"], "by_dtype": {}}
    for dtype_name in cfg.dtypes:
        fig = {key: max(r[dtype_name][key] for r in per_rank) for key in per_rank[0][dtype_name]}
        floor, logits_bytes = fig["floor_logsumexp"], fig["logits_bytes"]
        versus_ours = {
            f"{prefix}_{kind}_speedup_vs_ours": round(fig[f"ours_{kind}"] / fig[f"{prefix}_{kind}"], 2)
            for prefix in also
            for kind in ("fwd", "fwdbwd", "fwdbwd_inplace")
        }
        summary["by_dtype"][dtype_name] = {
            **{k: round(v, 5) if isinstance(v, float) else v for k, v in fig.items()},
            "fwd_over_floor": round(fig["ours_fwd"] / floor, 3),
            "fwdbwd_over_floor": round(fig["ours_fwdbwd"] / floor, 3),
            "composite_fwd_over_floor": round(fig["composite_fwd"] / floor, 3),
            "composite_fwdbwd_over_floor": round(fig["composite_fwdbwd"] / floor, 3),
            "fwd_speedup_vs_composite": round(fig["composite_fwd"] / fig["ours_fwd"], 2),
            "fwdbwd_speedup_vs_composite": round(fig["composite_fwdbwd"] / fig["ours_fwdbwd"], 2),
            "fwdbwd_inplace_speedup_vs_composite": round(fig["composite_fwdbwd"] / fig["ours_fwdbwd_inplace"], 2),
            "fwd_peak_extra_mem_frac": round(fig["ours_fwd_peak_extra_bytes"] / logits_bytes, 5),
            "composite_fwd_peak_extra_mem_frac": round(fig["composite_fwd_peak_extra_bytes"] / logits_bytes, 3),
            "fwdbwd_peak_extra_mem_frac": round(fig["ours_fwdbwd_peak_extra_bytes"] / logits_bytes, 3),
            "fwdbwd_inplace_peak_extra_mem_frac": round(fig["ours_fwdbwd_inplace_peak_extra_bytes"] / logits_bytes, 5),
            "composite_fwdbwd_peak_extra_mem_frac": round(fig["composite_fwdbwd_peak_extra_bytes"] / logits_bytes, 3),
            **versus_ours,
        }
    return summary


def print_table(summary: dict, cfg: BenchConfig) -> None:
    print(
        f"token stats: T={cfg.tokens} V={cfg.vocab} TP={cfg.tp} N={cfg.top_n} device={cfg.device} "
        f"impl={summary['impl']} cpu_isa={summary['cpu_isa']} repeats={cfg.repeats} (median; slowest rank)"
    )
    rows = [
        ("floor: torch.logsumexp", "floor_logsumexp", None),
        ("ours forward", "ours_fwd", "ours_fwd"),
        ("composite forward", "composite_fwd", "composite_fwd"),
        ("ours forward+backward", "ours_fwdbwd", "ours_fwdbwd"),
        ("ours fwd+bwd, in-place", "ours_fwdbwd_inplace", "ours_fwdbwd_inplace"),
        ("composite forward+backward", "composite_fwdbwd", "composite_fwdbwd"),
    ]
    for prefix, impl in summary["also"].items():
        rows += [
            (f"{impl} forward", f"{prefix}_fwd", None),
            (f"{impl} forward+backward", f"{prefix}_fwdbwd", None),
            (f"{impl} fwd+bwd, in-place", f"{prefix}_fwdbwd_inplace", None),
        ]
    for dtype_name, fig in summary["by_dtype"].items():
        print(f"\n[{dtype_name}] logits shard {fig['logits_bytes'] / 2**20:.0f} MiB per rank")
        print(f"  {'':30s} {'seconds':>9s} {'x floor':>8s} {'peak extra MiB':>15s} {'x logits':>9s}")
        for label, key, mem in rows:
            seconds = fig[key]
            extra = fig.get(f"{mem}_peak_extra_bytes") if mem else None
            mem_txt = f"{extra / 2**20:15.1f} {extra / fig['logits_bytes']:9.4f}" if extra is not None else ""
            print(f"  {label:30s} {seconds:9.4f} {seconds / fig['floor_logsumexp']:8.2f} {mem_txt}")
        print(
            f"  forward speedup vs composite {fig['fwd_speedup_vs_composite']:.2f}x; forward+backward "
            f"{fig['fwdbwd_speedup_vs_composite']:.2f}x (in-place {fig['fwdbwd_inplace_speedup_vs_composite']:.2f}x)"
        )
        for prefix, impl in summary["also"].items():
            print(
                f"  {impl} against ours ({summary['impl']}): forward {fig[f'{prefix}_fwd_speedup_vs_ours']:.2f}x, "
                f"forward+backward {fig[f'{prefix}_fwdbwd_speedup_vs_ours']:.2f}x "
                f"(in place {fig[f'{prefix}_fwdbwd_inplace_speedup_vs_ours']:.2f}x) faster"
            )


# The composite's forward+backward holds about 9-10x the fp32 shard (bf16: 20x its bf16 shard) beside the shard.
_COMPOSITE_FP32_SHARDS = 12


def check_memory(cfg: BenchConfig) -> None:
    """Refuse a shape whose composite would not fit in this machine's free memory (shared machines OOM badly)."""
    if cfg.device != "cpu":
        return
    import psutil

    need = cfg.tp * cfg.tokens * (cfg.vocab // cfg.tp) * 4 * _COMPOSITE_FP32_SHARDS
    available = psutil.virtual_memory().available
    if need > 0.8 * available:
        raise SystemExit(
            f"bench_token_stats: T={cfg.tokens}, V={cfg.vocab} needs about {need / 2**30:.1f} GiB for the composite "
            f"baseline but {available / 2**30:.1f} GiB is free; pass a smaller --tokens"
        )


_ISA_WORKER = """
import json, statistics, sys, time, torch
from megatron_rlvr.ops import backends, vocab_parallel_token_stats
tokens, vocab, repeats = map(int, sys.argv[1:4])
torch.set_num_threads(1)
x = torch.randn(tokens, vocab) * 2
y = torch.randint(0, vocab, (tokens,))
def fwdbwd():
    buf = x.clone().requires_grad_()
    s = vocab_parallel_token_stats(buf, y, 3, inplace_backward=True)
    torch.autograd.grad(s.logp.sum() + s.entropy.sum() + s.topn_logp.sum(), buf)
def median(fn):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return statistics.median(times)
with torch.no_grad():
    floor = median(lambda: torch.logsumexp(x, dim=-1))
    fwd = median(lambda: vocab_parallel_token_stats(x, y, 3))
print(json.dumps({"isa": backends.extension().cpu_isa(), "floor": floor, "fwd": fwd, "fwdbwd": median(fwdbwd)}))
"""


def isa_sweep(tokens: int, vocab: int, repeats: int) -> None:
    """Our CPU kernel built for each instruction set, against torch.logsumexp (ATen's vectorized exp), one thread."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    print(f"CPU instruction sets: T={tokens} V={vocab} fp32, one thread, TP=1 (median of {repeats})")
    print(
        f"  {'isa':8s} {'logsumexp s':>12s} {'ours fwd s':>11s} {'fwd/floor':>10s} {'fwd+bwd s':>10s} (fwd+bwd: "
        "in place, includes a clone of the logits)"
    )
    for isa in ("generic", "avx2", "avx512"):
        env = {**os.environ, "MEGATRON_RLVR_CPU_ISA": isa}
        done = subprocess.run(
            [sys.executable, "-c", _ISA_WORKER, str(tokens), str(vocab), str(repeats)],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if r["isa"] != isa:
            print(f"  {isa:8s} not supported by this CPU")
            continue
        print(f"  {isa:8s} {r['floor']:12.4f} {r['fwd']:11.4f} {r['fwd'] / r['floor']:10.2f} {r['fwdbwd']:10.4f}")


def implementation_list(text: str) -> tuple[str, ...]:
    """--also's value: names of implementations of the op (the parser refuses others, in the dry run too)."""
    from megatron_rlvr.ops import backends

    names = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in names if a not in backends.IMPLEMENTATIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; expected names from {backends.IMPLEMENTATIONS}")
    return names


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None, help="T (default 4096; --quick: 128)")
    parser.add_argument("--vocab", type=int, default=151936, help="V, padded up to a multiple of --tp")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--top-n", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; --quick: 3)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--also",
        type=implementation_list,
        default=(),
        help="comma list of implementations to time beside the default one, e.g. cuda-vector (ops/backends.py)",
    )
    parser.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="intra-op threads per rank (default: the CPU cores shared out, at least 1)",
    )
    parser.add_argument("--quick", action="store_true", help="T=128, V=32768, 3 repeats: under a minute")
    parser.add_argument(
        "--isa-sweep",
        action="store_true",
        help="only compare the CPU kernel's AVX-512 / AVX2 / baseline builds (TP=1, fp32, one thread)",
    )
    args = parser.parse_args(argv)
    if args.isa_sweep:
        isa_sweep(args.tokens or 256, args.vocab, args.repeats or 5)
        return {}
    import os

    tokens = args.tokens or (128 if args.quick else 4096)
    vocab = 32768 if args.quick and args.vocab == 151936 else args.vocab
    vocab = (vocab + args.tp - 1) // args.tp * args.tp
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.tp)
    cfg = BenchConfig(
        tokens=tokens,
        vocab=vocab,
        tp=args.tp,
        top_n=args.top_n,
        dtypes=tuple(d.strip() for d in args.dtypes.split(",")),
        repeats=args.repeats or (3 if args.quick else 5),
        device=args.device,
        threads_per_rank=threads,
        also=args.also,
    )
    check_memory(cfg)
    if cfg.tp == 1:
        torch.set_num_threads(threads)
        per_rank = [bench_rank(cfg)]
    else:
        from megatron_rlvr.testing.workers import WorkerGroup

        env = {"MEGATRON_RLVR_WORKER_THREADS": str(threads)}
        with WorkerGroup(cfg.tp, timeout_s=3600, env=env) as group:
            per_rank = group.run(bench_rank, cfg)
    summary = summarize(per_rank, cfg)
    print_table(summary, cfg)
    fp32 = summary["by_dtype"].get("float32") or next(iter(summary["by_dtype"].values()))
    headline = {
        key: fp32[key]
        for key in (
            "fwd_over_floor",
            "fwdbwd_speedup_vs_composite",
            "fwd_peak_extra_mem_frac",
            "fwd_speedup_vs_composite",
            "fwdbwd_inplace_speedup_vs_composite",
        )
    }
    result = {
        **headline,
        "tokens": cfg.tokens,
        "vocab": cfg.vocab,
        "tp": cfg.tp,
        "device": cfg.device,
        "impl": summary["impl"],
        "also": summary["also"],
        "cpu_isa": summary["cpu_isa"],
        "by_dtype": summary["by_dtype"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
