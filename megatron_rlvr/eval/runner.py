"""The large-K sampling runner: n answers per problem through any `RolloutEngine`, verified, stored as it goes.

Units and requests. The n samples of a problem are cut into chunks of `EvalConfig.chunk`. The problems of each
benchmark are cut, in file order, into blocks of `problems_per_request` (from `EvalConfig.request_samples`); one
engine request draws chunk j of every problem of one block: ``engine.generate(block prompts, chunk size, seed)``
with a seed that is a hash of (seed, benchmark, block, j). The engine seeds each prompt of a call by its position
(`VLLMEngine` gives prompt i its own seed derived from the call's seed and i), so a problem's samples depend only on
(seed, benchmark, block, j, position) and never on which other requests run or in what order. A request may draw a
prefix of its block (the block's problems up to the last one with missing samples; the problem list cut by
``limit``): positions, hence samples, stay the same. So a killed run, rerun with the same settings, draws exactly the
missing requests and its final table equals an uninterrupted run's.

The engine sees whole requests of many problems (thousands of sequences) instead of one problem's chunk, and the
reward pool scores request r (then appends it to the `SampleStore`) in a thread while the engine draws request r+1.

Several ranks (under torchrun): the world is cut into engine replicas of ``tp`` consecutive ranks (vLLM's own TP
groups). Rank 0 reads the store and plans the missing requests; the plan is broadcast; replica r draws requests
r, r + D, r + 2D, ... (D replicas); every rank of a replica makes the same generate calls and its first rank scores
and writes them (rank 0 to its store, the other replicas' first ranks to shards of their own in the same samples
directory). A last broadcast waits for every replica, after which the run directory holds every sample. With one
process both broadcasts are the identity.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rlvr.environments import EpisodeEngine
from megatron_rlvr.environments import Problem as EnvironmentProblem
from megatron_rlvr.errors import UserError
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.store import SampleStore, ShardWriter
from megatron_rlvr.problems.benchmarks import Problem
from megatron_rlvr.rewards.pool import RewardPool
from megatron_rlvr.rollout.base import Completion, RolloutEngine, Sampling

log = logging.getLogger(__name__)
PROMPT_FORMAT_VERSION = 1  # bump when benchmark prompt texts change: stored samples then no longer match


class EvalConfigError(UserError, ValueError):
    """An eval setting is out of range; the message names the flag."""


def request_seed(seed: int, benchmark: str, block: int, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{benchmark}/block{block}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def problems_per_request(cfg: EvalConfig) -> int:
    return max(1, cfg.request_samples // cfg.chunk)


def run_settings(cfg: EvalConfig, model: str, answer: str = "tagged", environment: str = "") -> dict:
    """What the stored samples depend on (n may grow between runs: more chunks, same earlier ones). ``answer`` is
    the reward's answer format (reward.answer), which the stored rewards depend on. ``environment``: the
    environment multi-turn samples were played against (docs/multi-turn.md). A system prompt, an answer format and
    an environment other than the defaults are recorded only when set, so runs stored before any existed still
    match."""
    settings = {
        "model": model,
        "seed": cfg.seed,
        "chunk": cfg.chunk,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "stop": list(cfg.stop),
        "chat_template": cfg.chat_template,
        "prompt_format": PROMPT_FORMAT_VERSION,
        "problems_per_request": problems_per_request(cfg),
    }
    if cfg.system_prompt is not None:
        settings["system_prompt"] = cfg.system_prompt
    if answer != "tagged":
        settings["answer"] = answer
    if environment:
        settings["environment"] = environment
    return settings


def validate_eval_config(cfg: EvalConfig) -> None:
    for flag, value in (
        ("--n", cfg.n_samples),
        ("--chunk", cfg.chunk),
        ("--max-new-tokens", cfg.max_new_tokens),
        ("--request-samples", cfg.request_samples),
    ):
        if value < 1:
            raise EvalConfigError(f"{flag}: must be >= 1, got {value}")


def torch_broadcast(obj):
    """Rank 0's ``obj`` on every rank of the default torch.distributed group (the identity for one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class Request:
    """One engine call: chunk ``chunk`` of ``problems`` (indices into the problem list, in block order)."""

    benchmark: str
    block: int
    chunk: int
    problems: tuple[int, ...]
    stored: frozenset[tuple[int, int]] = frozenset()  # (problem index, sample) already stored: drawn, not kept


class EvalRunner:
    """Samples, verifies and stores; `problem_counts` on the stored records then gives (n, c) for pass@k.

    ``rank``/``world``/``tp``: this process's place under torchrun (see the module docstring). A replica's first
    rank scores and writes, so it needs a pool; the other ranks of a replica only draw.
    """

    def __init__(
        self,
        engine: RolloutEngine | None,  # None: the run directory holds every sample, nothing is drawn
        encode: Callable[[str], list[int]],
        cfg: EvalConfig,
        pool: RewardPool | None,
        run_dir: str | Path,
        model: str,
        rank: int = 0,
        broadcast: Callable = torch_broadcast,
        world: int = 1,
        tp: int = 1,
        label: str = "",  # the progress bar's name for the model (its tag); default: the directory's name
        answer: str = "tagged",  # the pool's reward.answer: recorded in the run's settings
        environment: str = "",  # environment.name of an engine that plays episodes (an `EpisodeEngine`)
    ):
        validate_eval_config(cfg)
        if tp < 1 or world % tp:
            raise EvalConfigError(f"--tp {tp}: the world of {world} processes must be a multiple of it")
        self.engine, self.encode, self.cfg, self.pool, self.model = engine, encode, cfg, pool, model
        self.answer, self.environment = answer, environment
        self.run_dir = Path(run_dir)
        self.label = label or Path(model).name or model
        self.rank, self.broadcast, self.tp = rank, broadcast, tp
        self.replica, self.replicas = rank // tp, world // tp
        self.writes = rank % tp == 0  # the replica's first rank scores and writes
        if self.writes and pool is None:
            raise ValueError(f"EvalRunner: rank {rank} scores its replica's samples and needs a RewardPool")
        self.reward_counters: dict[str, int] = defaultdict(int)
        self.requests_drawn = 0
        self.samples_drawn = 0
        self.tokens_drawn = 0  # generated tokens of this session's requests (this replica's)
        self.draw_seconds = 0.0  # wall time of this session's drawing and scoring (engine start excluded)
        self.samples_planned = 0  # samples of every planned request (all replicas), kept ones excluded
        self.samples_missing_after = 0  # samples still missing when the run stopped (max_requests)

    def _chunks(self, n: int) -> list[range]:
        return [range(start, min(start + self.cfg.chunk, n)) for start in range(0, n, self.cfg.chunk)]

    def _plan(self, problems: Sequence[Problem], store: SampleStore) -> list[Request]:
        """Every request with a sample not yet stored, in (benchmark, block, chunk) order."""
        per_block = problems_per_request(self.cfg)
        positions: dict[str, list[int]] = defaultdict(list)  # benchmark -> its problems' indices, in order
        for i, problem in enumerate(problems):
            positions[problem.benchmark].append(i)
        plan = []
        for benchmark, indices in positions.items():
            for block, start in enumerate(range(0, len(indices), per_block)):
                members = indices[start : start + per_block]
                for j, samples in enumerate(self._chunks(self.cfg.n_samples)):
                    stored = {
                        (i, s) for i in members for s in samples if store.has((benchmark, problems[i].problem_id, s))
                    }
                    missing = [k for k, i in enumerate(members) if any((i, s) not in stored for s in samples)]
                    if missing:
                        drawn = tuple(members[: missing[-1] + 1])  # a prefix: positions (and samples) unchanged
                        kept = frozenset((i, s) for i, s in stored if i in drawn)
                        plan.append(Request(benchmark, block, j, drawn, kept))
        return plan

    def run(self, problems: Sequence[Problem], max_requests: int | None = None) -> None:
        """Draw every missing sample; ``max_requests``: only the first that many requests of the plan (a
        calibration: `megatron-rlvr eval --estimate`), the rest counted in ``samples_missing_after``."""
        store = writer = None
        try:
            plan: object = None
            if self.rank == 0:
                try:
                    store = writer = SampleStore(
                        self.run_dir, run_settings(self.cfg, self.model, self.answer, self.environment)
                    )
                    plan = self._plan(problems, store)
                except Exception as exc:
                    self.broadcast(("error", f"{type(exc).__name__}: {exc}"))  # the other ranks must not wait
                    raise
            plan = self.broadcast(plan)
            if isinstance(plan, tuple):
                raise UserError(f"eval: rank 0 failed: {plan[1]}")
            self.samples_planned = sum(_request_samples(r, self._chunks(self.cfg.n_samples)) for r in plan)
            if max_requests is not None:
                self.samples_missing_after = sum(
                    _request_samples(r, self._chunks(self.cfg.n_samples)) for r in plan[max_requests:]
                )
                plan = plan[:max_requests]
            if self.writes and writer is None:
                writer = ShardWriter(self.run_dir, self.rank)
            self._draw(problems, plan[self.replica :: self.replicas], writer if self.writes else None)
            self.broadcast(None)  # every replica's samples are on disk before rank 0 reads the run directory
        finally:
            if writer is not None:
                writer.close()

    def _draw(self, problems: Sequence[Problem], requests: list[Request], writer) -> None:
        cfg = self.cfg
        chunks = self._chunks(cfg.n_samples)
        encoded: dict[int, list[int]] = {}
        started = time.monotonic()
        total = sum(_request_samples(r, chunks) for r in requests)
        # this replica's samples; tqdm's remaining-time figure is its measured rate over what is left
        progress = _progress(writer is not None and self.rank == 0, total, self.label)
        kept = 0
        with progress, ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-scorer") as scorer:
            scoring: Future | None = None
            for step, request in enumerate(requests):
                for i in request.problems:
                    if i not in encoded:
                        encoded[i] = self.encode(problems[i].prompt)
                samples = chunks[request.chunk]
                sampling = Sampling(
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    max_tokens=cfg.max_new_tokens,
                    stop=list(cfg.stop),
                    seed=request_seed(cfg.seed, request.benchmark, request.block, request.chunk),
                    logprobs=False,
                )
                if isinstance(self.engine, EpisodeEngine):  # multi-turn: each sample a trajectory (docs/multi-turn.md)
                    posed = [
                        EnvironmentProblem(
                            problems[i].problem_id,
                            problems[i].prompt,
                            tuple(encoded[i]),
                            problems[i].task,
                            problems[i].reference,
                        )
                        for i in request.problems
                    ]
                    completions = self.engine.play(posed, len(samples), sampling)
                else:
                    completions = self.engine.generate([encoded[i] for i in request.problems], len(samples), sampling)
                if len(completions) != len(request.problems) or any(len(c) != len(samples) for c in completions):
                    raise RuntimeError(
                        f"engine returned {[len(c) for c in completions]} completions for "
                        f"{len(request.problems)} prompts x {len(samples)}"
                    )
                self.requests_drawn += 1
                self.samples_drawn += len(request.problems) * len(samples)
                self.tokens_drawn += sum(len(c.token_ids) for drawn in completions for c in drawn)
                kept += _request_samples(request, chunks)
                progress.update(_request_samples(request, chunks))
                if writer is None:
                    continue
                if scoring is not None:
                    scoring.result()  # at most one request is being scored while the engine draws the next
                scoring = scorer.submit(self._score_and_store, problems, request, samples, completions, writer)
                elapsed = time.monotonic() - started
                done = kept / max(total, 1)
                log.info(
                    "%s: request %d/%d (%s, %d problems x %d samples) drawn at %.0f s, about %.0f s left",
                    self.model,
                    step + 1,
                    len(requests),
                    request.benchmark,
                    len(request.problems),
                    len(samples),
                    elapsed,
                    elapsed * (1 - done) / done if done else float("nan"),
                )
            if scoring is not None:
                scoring.result()
        self.draw_seconds += time.monotonic() - started

    def _score_and_store(
        self, problems: Sequence[Problem], request: Request, samples: range, completions: list[list[Completion]], writer
    ) -> None:
        items = [
            (i, s, completion)
            for i, drawn in zip(request.problems, completions)
            for s, completion in zip(samples, drawn)
            if (i, s) not in request.stored
        ]
        pooled = [k for k, (_, _, c) in enumerate(items) if c.episode is None]  # episodes: their return
        pool_rewards, counters = self.pool.score_batch(
            [problems[items[k][0]].task for k in pooled],
            [items[k][2].text for k in pooled],
            [problems[items[k][0]].reference for k in pooled],
        )
        by_item = dict(zip(pooled, pool_rewards))
        rewards = [by_item[k] if c.episode is None else c.episode.env_return for k, (_, _, c) in enumerate(items)]
        for key, value in counters.items():
            self.reward_counters[key] += value
        for _, _, c in items:
            if c.episode is not None and c.episode.failure:
                self.reward_counters[f"env_{c.episode.failure}"] += 1
        save_text = self.cfg.save_text
        writer.append(
            {
                "benchmark": problems[i].benchmark,
                "problem_id": problems[i].problem_id,
                "sample": s,
                "chunk": request.chunk,
                "reward": reward,
                "finish_reason": c.finish_reason,
                "num_tokens": len(c.token_ids),
                "text": c.text if save_text else None,
                **({} if c.episode is None else {"turns": c.episode.turns}),
            }
            for (i, s, c), reward in zip(items, rewards)
        )


def _request_samples(request: Request, chunks: list[range]) -> int:
    """Samples a request keeps (drawn minus those already stored)."""
    return len(request.problems) * len(chunks[request.chunk]) - len(request.stored)


def _progress(enabled: bool, total: int, name: str):
    from tqdm import tqdm

    return tqdm(
        total=total, desc=f"eval {name}", unit="sample", unit_scale=True, disable=not enabled, dynamic_ncols=True
    )


def problem_counts(
    records: dict, problems: Sequence[Problem], n_samples: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
