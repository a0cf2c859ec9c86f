"""The MoE actor at EP=1 against EP=2, side by side in one run on CPU (2 gloo processes each, fp32).

The same random Qwen3-MoE (8 experts, top-2, one dense layer) and the same packed batch on both layouts: at EP=1
each rank holds every expert (DP=2), at EP=2 each holds half of them and the all-to-all dispatcher moves the tokens
between the two. Per layout: the actor step time (the statistics pass plus one update, median of the timed steps
after a warm-up step), the peak anonymous resident memory of a step above what the process held before the actor
was built (tools/benches/measure_memory.py's sampler), and the dispatcher's share of the step: the wall time inside
megatron-core's MoEAlltoAllTokenDispatcher (dispatch_preprocess, token_dispatch, dispatch_postprocess,
combine_preprocess, token_combine, combine_postprocess) plus the backward of its all-to-alls (_AllToAll.backward);
the backward of the permutations runs inside autograd's own nodes and is not counted.

    OMP_NUM_THREADS=1 python tools/benches/bench_moe.py            # prints a table, then one JSON line
    OMP_NUM_THREADS=1 python tools/benches/bench_moe.py --quick    # fewer tokens and steps

Each figure is the maximum over the 2 ranks (a step ends when both have). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_rlvr.testing.configs import algo_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# the tiny Qwen3-MoE of testing/tiny_models.py (8 experts, top-2, layer 1 dense, 4 layers) at a larger width
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64)
DISPATCHER_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


class DispatcherClock:
    """Adds up the wall time spent in the all-to-all dispatcher's methods and its all-to-alls' backward."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, static: bool = False) -> None:
        real = owner.__dict__[name]
        fn = real.__func__ if static else real

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        self._saved.append((owner, name, real))
        setattr(owner, name, staticmethod(timed) if static else timed)

    def __enter__(self) -> DispatcherClock:
        from megatron.core.tensor_parallel.mappings import _AllToAll
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        for name in DISPATCHER_METHODS:
            self._wrap(MoEAlltoAllTokenDispatcher, name)
        self._wrap(_AllToAll, "backward", static=True)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def _batch(vocab: int, sequences: int, seq_len: int):
    import torch

    from megatron_rlvr.protocols import Targets
    from megatron_rlvr.testing.handoffs import rollouts

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (sequences, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (sequences,), generator=g)
    mask = torch.zeros(sequences, seq_len - 1, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, 8 : n - 1] = True
        tokens[i, n:] = 0
    return rollouts(tokens, mask), Targets(advantages=torch.linspace(-1, 1, sequences))


def run_layout(hf_dir: str, ep: int, sequences: int, seq_len: int, steps: int) -> dict:
    """On each rank: build the actor at EP=ep, run warm-up + ``steps`` steps; times, peak memory, dispatcher time."""
    import torch.distributed as dist

    from megatron_rlvr.actor.config import ActorConfig
    from megatron_rlvr.actor.megatron_actor import MegatronActor
    from megatron_rlvr.models.config import ModelConfig
    from megatron_rlvr.runtime.distributed import model_parallel
    from tools.benches.measure_memory import PeakSampler, _rss_anon, _trim

    _trim()
    base = _rss_anon()
    with model_parallel(tp=1, pp=1, seed=5, ep=ep, etp=1):
        actor = MegatronActor(
            ModelConfig(hf_dir=hf_dir),
            ActorConfig(ep=ep, etp=1, micro_batch_size=sequences // 2, lr=1e-4, pack_sequences=True),
            algo_config({"loss.kind": "casp"}),
            temperature=1.0,
            total_steps=steps + 1,
        )
        batch, targets = _batch(actor.vocab_size, sequences, seq_len)
        times, dispatch, peak = [], [], 0
        for step in range(steps + 1):
            _trim()
            dist.barrier()
            with PeakSampler() as sampler, DispatcherClock() as clock:
                start = time.perf_counter()
                metrics = actor.update(batch, targets, actor.statistics_pass(batch), mini_batches=1)
                dist.barrier()
                elapsed = time.perf_counter() - start
            if step:  # the first step builds Adam's state and warms the kernels
                times.append(elapsed)
                dispatch.append(clock.seconds)
                peak = max(peak, sampler.peak - base)
        params = sum(p.numel() for c in actor.model_chunks for p in c.parameters())
        del actor
    return {
        "step_s": statistics.median(times),
        "dispatcher_s": statistics.median(dispatch),
        "peak_bytes": peak,
        "params": params,
        "loss": metrics["actor/loss"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=8, help="sequences per step (the whole DP group's)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    p.add_argument("--quick", action="store_true", help="4 sequences of 128 tokens, 2 timed steps")
    args = p.parse_args(argv)
    if args.quick:
        args.sequences, args.seq_len, args.steps = 4, 128, 2
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # RSS follows live bytes (measure_memory.py)
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model
    from megatron_rlvr.testing.workers import WorkerGroup

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(make_tiny_hf_model("qwen3_moe", Path(tmp) / "moe", with_tokenizer=False, seed=3, **MODEL))
        for ep in (1, 2):
            with WorkerGroup(2, timeout_s=1800) as group:  # a fresh group per layout: nothing carried over
                ranks = group.run(run_layout, hf_dir, ep, args.sequences, args.seq_len, args.steps)
            results[ep] = {
                "step_s": max(r["step_s"] for r in ranks),
                "dispatcher_s": max(r["dispatcher_s"] for r in ranks),
                "peak_mb": max(r["peak_bytes"] for r in ranks) / 1e6,
                "params_per_rank": ranks[0]["params"],
                "loss": ranks[0]["loss"],
            }
    print(
        f"model: random Qwen3-MoE {MODEL}; 2 gloo processes per layout, fp32 CPU; {args.sequences} packed "
        f"sequences of <= {args.seq_len} tokens per step (statistics pass + one update); median of {args.steps} "
        f"steps after a warm-up; one run"
    )
    print(f"{'layout':<18}{'params/rank':>12}{'step s':>9}{'dispatcher s':>14}{'share':>7}{'peak MB':>9}{'loss':>12}")
    for ep, r in results.items():
        share = r["dispatcher_s"] / r["step_s"]
        label = "EP=1 (DP=2)" if ep == 1 else "EP=2"
        print(
            f"{label:<18}{r['params_per_rank']:>12}{r['step_s']:>9.3f}{r['dispatcher_s']:>14.3f}{share:>7.1%}"
            f"{r['peak_mb']:>9.1f}{r['loss']:>12.6g}"
        )
    one, two = results[1], results[2]
    summary = {
        "ep1_step_s": round(one["step_s"], 4),
        "ep2_step_s": round(two["step_s"], 4),
        "ep2_over_ep1_step_time": round(two["step_s"] / one["step_s"], 3),
        "ep1_peak_mb": round(one["peak_mb"], 1),
        "ep2_peak_mb": round(two["peak_mb"], 1),
        "ep2_over_ep1_peak_memory": round(two["peak_mb"] / one["peak_mb"], 3),
        "ep1_dispatcher_share": round(one["dispatcher_s"] / one["step_s"], 4),
        "ep2_dispatcher_share": round(two["dispatcher_s"] / two["step_s"], 4),
        "ep1_params_per_rank": one["params_per_rank"],
        "ep2_params_per_rank": two["params_per_rank"],
        "loss_rel_diff": abs(two["loss"] - one["loss"]) / max(abs(one["loss"]), 1e-12),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
