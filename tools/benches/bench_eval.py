"""The eval runner against vLLM's own `generate` of the same prompts, n and sampling, on one engine, in one run.

    python tools/benches/bench_eval.py --quick                 # the demo model, 64 countdown problems x 128 samples
    python tools/benches/bench_eval.py --model DIR --problems 64 --n 1024 --max-new-tokens 4096 --max-model-len 8192

Both sides run on the same `VLLMEngine` (same engine settings, started once, warmed up once, its start not timed):
"raw" is one ``LLM.generate`` call with every prompt and ``SamplingParams(n=...)`` (what a hand-written loop would
do; nothing verified or stored), "eval" is `EvalRunner.run` on a fresh run directory (requests of many problems,
rewards verified in the pool, every sample written to the store). ``--per-problem`` also times the runner with one
problem per request (``request_samples = chunk``: the runner before batching). Rounds alternate raw and eval.
The last line is one JSON object: eval_samples_per_s, raw_samples_per_s, eval_over_raw (medians over rounds),
and the per-round figures.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from megatron_rlvr.config import load_config

    recipe = load_config(REPO / "configs" / "demo_cpu.yaml")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "megatron_rlvr" / "demo" / "model"), help="HF model directory")
    p.add_argument("--problems", type=int, default=64, help="countdown eval problems (the demo task's eval split)")
    p.add_argument("--n", type=int, default=128, help="samples per problem")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--request-samples", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=recipe.rollout.temperature)
    p.add_argument("--max-new-tokens", type=int, default=recipe.rollout.max_new_tokens)
    p.add_argument("--stop", nargs="*", default=list(recipe.rollout.stop))
    p.add_argument("--max-model-len", type=int, default=recipe.rollout.max_model_len)
    p.add_argument("--kv-cache-bytes", type=int, default=recipe.rollout.kv_cache_memory_bytes, help="CPU engines")
    p.add_argument("--rounds", type=int, default=2, help="alternating raw / eval rounds")
    p.add_argument("--per-problem", action="store_true", help="also time the runner with one problem per request")
    p.add_argument("--quick", action="store_true", help="64 problems x 128 samples, 3 rounds (the issue's check)")
    args = p.parse_args(argv)
    if args.quick:
        args.problems, args.n, args.rounds = 64, 128, 3
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    from megatron_rlvr.runtime.console import setup_console

    setup_console()
    from vllm import SamplingParams

    from megatron_rlvr.eval.api import hf_encoder_factory, vllm_engine_factory
    from megatron_rlvr.eval.config import EvalConfig
    from megatron_rlvr.eval.runner import EvalRunner
    from megatron_rlvr.problems.benchmarks import load_benchmark
    from megatron_rlvr.rewards import RewardConfig, RewardPool
    from megatron_rlvr.rollout.base import Sampling
    from megatron_rlvr.tasks.countdown import generate as countdown_problems

    work = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    with open(work / "countdown.jsonl", "w") as f:
        for p in countdown_problems(0, args.problems, "eval"):
            f.write(json.dumps({"id": p.id, "numbers": list(p.numbers), "target": p.target}) + "\n")
    problems = load_benchmark("countdown", work)[: args.problems]
    cfg = EvalConfig(
        n_samples=args.n,
        chunk=min(args.chunk, args.n),
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop=list(args.stop),
        benchmarks=["countdown"],
        data_dir=str(work),
        request_samples=args.request_samples,
    )
    engine = vllm_engine_factory(args.max_model_len, args.kv_cache_bytes)(args.model, cfg)
    encode = hf_encoder_factory(args.model, cfg)
    prompts = [{"prompt_token_ids": encode(p.prompt)} for p in problems]
    samples = len(problems) * args.n
    print(
        f"engine up in {engine.start_seconds:.1f} s; {len(problems)} problems x n={args.n} = {samples} samples, "
        f"max_new_tokens={args.max_new_tokens}, stop={args.stop}",
        flush=True,
    )

    def raw() -> tuple[float, int]:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            max_tokens=args.max_new_tokens,
            stop=list(args.stop) or None,
            seed=cfg.seed,
        )
        start = time.perf_counter()
        outputs = engine._llm.generate(prompts, params, use_tqdm=False)  # vLLM itself: the same LLM object
        seconds = time.perf_counter() - start
        return seconds, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def run_eval(pool, run_dir: Path, request_samples: int) -> tuple[float, int]:
        c = EvalConfig(**{**cfg.__dict__, "request_samples": request_samples})
        runner = EvalRunner(engine, encode, c, pool, run_dir, model=args.model)
        start = time.perf_counter()
        runner.run(problems)
        seconds = time.perf_counter() - start
        from megatron_rlvr.eval.store import load_records

        records = load_records(run_dir)
        assert len(records) == samples, f"{len(records)} of {samples} samples stored"
        return seconds, sum(r["num_tokens"] for r in records.values())

    rounds = []
    with RewardPool(RewardConfig(workers=1)) as pool:
        engine.generate([prompts[0]["prompt_token_ids"]], 8, Sampling(max_tokens=args.max_new_tokens))  # warm-up
        for r in range(args.rounds):
            raw_s, raw_tokens = raw()
            eval_s, eval_tokens = run_eval(pool, work / f"eval-{r}", args.request_samples)
            row = {
                "raw_s": round(raw_s, 2),
                "eval_s": round(eval_s, 2),
                "raw_tokens": raw_tokens,
                "eval_tokens": eval_tokens,
            }
            if args.per_problem:
                per_s, _ = run_eval(pool, work / f"per-problem-{r}", cfg.chunk)
                row["per_problem_eval_s"] = round(per_s, 2)
            print(f"round {r}: {row}", flush=True)
            rounds.append(row)
    engine.close()
    raw_rate = statistics.median(samples / row["raw_s"] for row in rounds)
    eval_rate = statistics.median(samples / row["eval_s"] for row in rounds)
    result = {
        "model": args.model,
        "problems": len(problems),
        "n": args.n,
        "chunk": cfg.chunk,
        "request_samples": args.request_samples,
        "max_new_tokens": args.max_new_tokens,
        "rounds": rounds,
        "eval_samples_per_s": round(eval_rate, 1),
        "raw_samples_per_s": round(raw_rate, 1),
        "eval_over_raw": round(eval_rate / raw_rate, 3),
    }
    if args.per_problem:
        result["per_problem_samples_per_s"] = round(
            statistics.median(samples / r["per_problem_eval_s"] for r in rounds), 1
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
