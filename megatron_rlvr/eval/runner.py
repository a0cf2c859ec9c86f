"""The large-K sampling runner: n answers per problem through any `RolloutEngine`, verified, stored as it goes.

For each problem the n samples are cut into chunks of `EvalConfig.chunk`; chunk j is one ``engine.generate`` call
whose sampling seed is a hash of (seed, benchmark, problem id, j), so any chunk can be redrawn identically. A chunk
is scored with the `RewardPool` and its records appended to the `SampleStore` at once; a chunk whose samples are all
stored is skipped. So a killed run, rerun with the same settings, draws exactly the missing chunks and its final
table equals an uninterrupted run's. The engine is whatever the caller passes (vLLM, or a test fake): swapping it is
one line.

Several ranks (a TP>1 vLLM engine under torchrun, where every rank must make the same generate calls): rank 0 reads
the store and decides which chunks to draw, the plan is broadcast, every rank draws them, and only rank 0 scores and
writes. With one process the broadcast is the identity.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from megatron_rlvr.eval.benchmarks import Problem
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.store import SampleStore
from megatron_rlvr.rewards.pool import RewardPool
from megatron_rlvr.rollout.base import RolloutEngine, Sampling

log = logging.getLogger(__name__)
PROMPT_FORMAT_VERSION = 1  # bump when benchmark prompt texts change: stored samples then no longer match


def chunk_seed(seed: int, benchmark: str, problem_id: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem_id}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def run_settings(cfg: EvalConfig, model: str) -> dict:
    """What the stored samples depend on (n may grow between runs: more chunks, same earlier ones)."""
    return {
        "model": model, "seed": cfg.seed, "chunk": cfg.chunk, "temperature": cfg.temperature, "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens, "stop": list(cfg.stop), "chat_template": cfg.chat_template,
        "prompt_format": PROMPT_FORMAT_VERSION,
    }


def validate_eval_config(cfg: EvalConfig) -> None:
    if cfg.n_samples < 1:
        raise ValueError(f"eval.n_samples: must be >= 1, got {cfg.n_samples}")
    if cfg.chunk < 1:
        raise ValueError(f"eval.chunk: must be >= 1, got {cfg.chunk}")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"eval.max_new_tokens: must be >= 1, got {cfg.max_new_tokens}")


def torch_broadcast(obj):
    """Rank 0's ``obj`` on every rank of the default torch.distributed group (the identity for one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class EvalRunner:
    """Samples, verifies and stores; `problem_counts` on the stored records then gives (n, c) for pass@k.

    ``rank`` > 0 (a follower of a multi-rank engine) draws what rank 0's plan says and writes nothing; it needs no
    pool. ``broadcast`` sends rank 0's plan to every rank.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        encode: Callable[[str], list[int]],
        cfg: EvalConfig,
        pool: RewardPool | None,
        run_dir: str | Path,
        model: str,
        rank: int = 0,
        broadcast: Callable = torch_broadcast,
    ):
        validate_eval_config(cfg)
        if rank == 0 and pool is None:
            raise ValueError("EvalRunner: rank 0 scores the samples and needs a RewardPool")
        self.engine, self.encode, self.cfg, self.pool, self.model = engine, encode, cfg, pool, model
        self.run_dir = Path(run_dir)
        self.rank, self.broadcast = rank, broadcast
        self.reward_counters: dict[str, int] = defaultdict(int)
        self.chunks_drawn = 0

    def _chunks(self, n: int) -> list[range]:
        return [range(start, min(start + self.cfg.chunk, n)) for start in range(0, n, self.cfg.chunk)]

    def _plan(self, problems: Sequence[Problem], store: SampleStore) -> list[tuple[int, int]]:
        """(problem index, chunk index) of every chunk with a sample not yet stored, in order."""
        return [
            (i, j)
            for i, problem in enumerate(problems)
            for j, samples in enumerate(self._chunks(self.cfg.n_samples))
            if any(not store.has((problem.benchmark, problem.problem_id, s)) for s in samples)
        ]

    def run(self, problems: Sequence[Problem]) -> None:
        store = SampleStore(self.run_dir, run_settings(self.cfg, self.model)) if self.rank == 0 else None
        try:
            plan = self.broadcast(self._plan(problems, store) if store is not None else None)
            self._draw(problems, plan, store)
        finally:
            if store is not None:
                store.close()

    def _draw(self, problems: Sequence[Problem], plan: list[tuple[int, int]], store: SampleStore | None) -> None:
        cfg = self.cfg
        chunks = self._chunks(cfg.n_samples)
        started, encoded = time.monotonic(), {}
        for step, (i, j) in enumerate(plan):
            problem, samples = problems[i], chunks[j]
            if i not in encoded:
                encoded = {i: self.encode(problem.prompt)}
            # the whole chunk is drawn even when some of it is stored, so its seed gives the same samples
            sampling = Sampling(
                temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, stop=list(cfg.stop),
                seed=chunk_seed(cfg.seed, problem.benchmark, problem.problem_id, j), logprobs=False,
            )
            completions = self.engine.generate([encoded[i]], len(samples), sampling)
            if len(completions) != 1 or len(completions[0]) != len(samples):
                raise RuntimeError(f"engine returned {[len(c) for c in completions]} completions for 1 prompt x {len(samples)}")
            self.chunks_drawn += 1
            if store is None:
                continue
            by_sample = dict(zip(samples, completions[0]))
            missing = [s for s in samples if not store.has((problem.benchmark, problem.problem_id, s))]
            rewards, counters = self.pool.score_batch(
                [problem.task] * len(missing), [by_sample[s].text for s in missing], [problem.reference] * len(missing)
            )
            for key, value in counters.items():
                self.reward_counters[key] += value
            store.append(
                {
                    "benchmark": problem.benchmark, "problem_id": problem.problem_id, "sample": s, "chunk": j,
                    "reward": reward, "finish_reason": by_sample[s].finish_reason,
                    "num_tokens": len(by_sample[s].token_ids), "text": by_sample[s].text if cfg.save_text else None,
                }
                for s, reward in zip(missing, rewards)
            )
            if step + 1 == len(plan) or plan[step + 1][0] != i:
                log.info("%s %s/%s done: %d/%d chunks drawn (%.0f s)", self.model, problem.benchmark,
                         problem.problem_id, step + 1, len(plan), time.monotonic() - started)


def problem_counts(records: dict, problems: Sequence[Problem], n_samples: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per benchmark: arrays (n, c) over its problems from stored records (samples < n_samples only).

    A problem with fewer than n_samples stored samples is an error: the table is only made from complete runs.
    """
    n_by: dict[tuple[str, str], int] = defaultdict(int)
    c_by: dict[tuple[str, str], int] = defaultdict(int)
    for (bench, pid, sample), record in records.items():
        if sample < n_samples:
            n_by[(bench, pid)] += 1
            c_by[(bench, pid)] += 1 if record["reward"] >= 1.0 else 0
    out: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for problem in problems:
        key = (problem.benchmark, problem.problem_id)
        if n_by[key] != n_samples:
            raise RuntimeError(f"{problem.benchmark}/{problem.problem_id}: {n_by[key]} of {n_samples} samples stored")
        out[problem.benchmark][0].append(n_by[key])
        out[problem.benchmark][1].append(c_by[key])
    return {bench: (np.array(n), np.array(c)) for bench, (n, c) in out.items()}
