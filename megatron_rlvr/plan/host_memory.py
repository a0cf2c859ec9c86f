"""Host memory per node of a recipe's layout, as pure arithmetic of (Config, HF config, nodes): the plan's second
table, beside the per-GPU one (plan/memory.py). Nothing here imports torch.

Per rank, from what this project's code allocates in host memory (docs/weight-sync.md):
- staging (``rollout.sync_staging: full``): the engine rank's shard of the weight stream, checked whole and kept
  until the commit (rollout/shard_stage.py): HF bytes / engine TP + the replicated norms. "streaming": none. On CPU
  the in-process engine's direct loader keeps a second buffer of every weight instead (rollout/cpu_weights.py):
  the model's bytes, held from the second sync on.
- sleep-mode offload (colocated GPU engines): level 1 moves the engine's weights to host memory while the actor
  trains (HF bytes / engine TP per rank); level 2 drops them (re-sent at the next sync): none.
- transfer buckets: the export's shared-memory exchange (two slots per TP rank, each at least SHM_SLOT_BYTES or the
  largest TP shard) and two lending rounds of at most ``rollout.bucket_bytes``, in /dev/shm, i.e. host RAM (the
  pages a sync touches).
- the reward pool, per rank (every rank runs one): ``reward.workers`` x (the code sandbox's memory budget +
  its tmpfs) for code, else workers x a verifier process's resident set (an estimate, below).
- the data loader: every rank holds the tokenized train split (an estimate from the row count and prompt length).
- the rank's own process: Python, torch, megatron-core, vLLM, the CUDA host-side runtime (an estimate on GPU; on
  CPU measured on this machine); the node's launcher (torchrun), once per node.
- on CPU only, the actor and the engine themselves live in host memory (plan/memory.py's CPU arithmetic for the
  actor; the engine's weights at fp32 and its ``kv_cache_memory_bytes``).

A node fits when the sum over its ranks stays within ``cluster.host_memory_gb`` less HOST_HEADROOM_FRACTION (the
OS, page cache, the container). Sizes in bytes; GB = 10^9 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlvr.plan.memory import FP32, GB, Layout, actor_rank_plan
from megatron_rlvr.plan.model_dims import ModelDims

# Assumptions not measured here (GPU nodes), named:
GPU_RANK_PROCESS_BYTES = int(8.0 * GB)  # one GPU rank's process: CUDA host runtime, NCCL, torch, megatron, vLLM
# one verifier worker: measured 53 MB PSS once started (Python + math_verify + sympy imported, this machine); twice
# that for what sympy caches while it scores
VERIFIER_RESIDENT_BYTES = int(0.1 * GB)
DATA_ROW_OVERHEAD_BYTES = 2048  # one prompt row's Python objects beyond its token ids (text, answer, id, dict)
BYTES_PER_TOKEN_ID = 36  # a token id in a Python list: the 8-byte slot and a 28-byte int object
DEFAULT_DATA_ROWS = 100_000  # rows assumed when the data file is not readable here
HOST_HEADROOM_FRACTION = 0.10
# Measured on this project's CPU machine: one process's PSS after importing torch, megatron-core, the trainer and
# vLLM and starting a vLLM engine for the demo model, less the engine's weights and KV cache (0.50 GB; alone in its
# process, so the shared libraries count whole: ranks that share them count less each).
CPU_RANK_PROCESS_BYTES = int(0.5 * GB)
# the node's launcher (torchrun's agent: Python + torch.distributed imported): measured 157 MB PSS on this machine
LAUNCHER_BYTES = int(0.16 * GB)
SHM_SLOT_BYTES = 64 << 20  # bridge/export.py: the exchange's per-rank slot (at least the largest TP shard)

LABELS = {
    "staging": "staged weight shard (sync)",
    "sleep_offload": "sleep-mode offload",
    "transfer_buckets": "transfer buckets (/dev/shm)",
    "reward_pool": "reward pool",
    "data_loader": "data loader (estimate)",
    "process": "rank processes (estimate)",
    "launcher": "launcher (torchrun)",
    "actor": "actor (CPU)",
    "engine": "engine weights + KV (CPU)",
}


@dataclass
class HostPlan:
    """The host memory of the fullest node: its components (summed over its ranks), the total and whether it fits."""

    host_memory: int  # bytes per node; 0: unknown (not checked)
    components: dict[str, int]
    ranks: dict[str, int]  # rank kind -> how many on the fullest node
    headroom: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.host_memory <= 0 or self.total + self.headroom <= self.host_memory

    def breaker(self) -> tuple[str, int] | None:
        if self.fits:
            return None
        return max(self.components.items(), key=lambda kv: kv[1])


def _norm_values(dims: ModelDims) -> int:
    return (2 * dims.layers + 1) * dims.hidden


def staged_bytes(dims: ModelDims, engine_tp: int, value_bytes: int) -> int:
    """One engine rank's staged shard: the HF weights / engine TP, the replicated norms whole."""
    sharded = dims.hf_params() - _norm_values(dims)
    return (sharded // engine_tp + _norm_values(dims)) * value_bytes


def engine_weight_bytes(dims: ModelDims, engine_tp: int, value_bytes: int) -> int:
    return dims.hf_params() * value_bytes // engine_tp


def transfer_bucket_bytes(dims: ModelDims, lay: Layout) -> int:
    """One actor rank's touched /dev/shm (only with actor TP > 1): its two exchange slots (each the larger of
    SHM_SLOT_BYTES and its largest shard, filled at most with its share of the model) and its share of the lending
    slots (two rounds of at most ``rollout.bucket_bytes`` in TP rank 0's segment)."""
    if lay.tp == 1:
        return 0
    model = dims.hf_params() * lay.param_bytes
    slot = max(SHM_SLOT_BYTES, max(dims.vocab * dims.hidden, 2 * dims.ffn * dims.hidden) // lay.tp * lay.param_bytes)
    return 2 * min(slot, model // lay.tp) + 2 * min(lay.bucket_bytes, lay.tp * slot, model) // lay.tp


def reward_pool_bytes(cfg: Any) -> int:
    r = cfg.reward
    if cfg.data.task == "code":
        return r.workers * (r.code_memory_mb + r.code_tmpfs_mb) * 2**20 + r.workers * VERIFIER_RESIDENT_BYTES
    return r.workers * VERIFIER_RESIDENT_BYTES


def data_rows(cfg: Any) -> int:
    """Rows of the train split: the file's lines when it is readable here, the demo split's size for the embedded
    task, else DEFAULT_DATA_ROWS."""
    if not cfg.data.path:
        return cfg.data.demo_train_problems
    path = Path(cfg.data.path)
    if path.suffix == ".jsonl" and path.is_file():
        with path.open("rb") as f:
            return sum(1 for _ in f)
    return DEFAULT_DATA_ROWS


def data_loader_bytes(cfg: Any) -> int:
    """The tokenized train split one rank holds: rows x (half the prompt budget in token ids + the row's objects)."""
    per_row = cfg.data.max_prompt_tokens // 2 * BYTES_PER_TOKEN_ID + DATA_ROW_OVERHEAD_BYTES
    return data_rows(cfg) * per_row


def _rank_kinds(lay: Layout, world: int, gpus_per_node: int) -> dict[str, int]:
    """Rank kinds on the fullest node: colocated ranks, or actor and engine ranks (engines on the last ranks)."""
    if lay.placement != "separate":
        return {"colocated": min(world, gpus_per_node)}
    first_engine = world - lay.engine_ranks
    best: dict[str, int] = {}
    for node in range(max(1, math.ceil(world / gpus_per_node))):
        ranks = range(node * gpus_per_node, min(world, (node + 1) * gpus_per_node))
        kinds = {"actor": sum(r < first_engine for r in ranks), "engine": sum(r >= first_engine for r in ranks)}
        if (
            not best
            or sum(kinds.values()) > sum(best.values())
            or (sum(kinds.values()) == sum(best.values()) and kinds["engine"] > best["engine"])
        ):
            best = kinds
    return {k: v for k, v in best.items() if v}


def host_plan(
    cfg: Any, hf: Mapping[str, Any], lay: Layout, world: int, gpus_per_node: int, host_memory_gb: float
) -> HostPlan:
    """The fullest node's host memory for ``cfg`` laid out as ``lay`` on ``world`` ranks (GPU or CPU per ``lay``)."""
    dims = ModelDims.from_hf(hf)
    r = cfg.rollout
    engine_tp = lay.engine_tp if lay.gpu else 1
    value_bytes = lay.param_bytes if lay.gpu else FP32
    kinds = _rank_kinds(lay, world, gpus_per_node)
    c = dict.fromkeys(LABELS if not lay.gpu else [k for k in LABELS if k not in ("actor", "engine")], 0)
    process = GPU_RANK_PROCESS_BYTES if lay.gpu else CPU_RANK_PROCESS_BYTES
    full = r.sync_staging == "full"
    c["launcher"] = LAUNCHER_BYTES
    for kind, count in kinds.items():
        has_engine = kind in ("colocated", "engine")
        has_actor = kind in ("colocated", "actor")
        c["process"] += count * process
        c["reward_pool"] += count * reward_pool_bytes(cfg)
        c["data_loader"] += count * data_loader_bytes(cfg)
        if has_actor:
            c["transfer_buckets"] += count * transfer_bucket_bytes(dims, lay)
        if has_engine and full:
            c["staging"] += count * (
                staged_bytes(dims, engine_tp, value_bytes) if lay.gpu else engine_weight_bytes(dims, 1, FP32)
            )
        if has_engine and lay.gpu and kind == "colocated" and lay.sleep_level == 1:
            c["sleep_offload"] += count * engine_weight_bytes(dims, engine_tp, value_bytes)
        if not lay.gpu:
            if has_actor:
                actor = actor_rank_plan(dims, lay, 0, 0)
                c["actor"] += count * actor.peak
            if has_engine:
                c["engine"] += count * (engine_weight_bytes(dims, 1, FP32) + r.kv_cache_memory_bytes)
    host = int(host_memory_gb * GB)
    notes = []
    if host_memory_gb <= 0:
        notes.append("cluster.host_memory_gb is not set: host memory is shown, not checked")
    if lay.gpu and kinds.get("colocated", 0) + kinds.get("engine", 0):
        engines = kinds.get("colocated", 0) + kinds.get("engine", 0)
        whole = engines * dims.hf_params() * value_bytes
        notes.append(
            f"staging: rollout.sync_staging={r.sync_staging}; 'streaming' stages nothing, and a full stage "
            f"of the whole model per engine rank would be {whole / GB:.1f} GB here"
        )
    return HostPlan(host, c, kinds, headroom=int(HOST_HEADROOM_FRACTION * host), notes=notes)


def host_header_line(plan: HostPlan) -> str:
    """The host plan in one recipe-header line (tests/plan checks every H200 recipe carries its current one)."""
    parts = ", ".join(f"{LABELS[k].split(' (')[0]} {v / GB:.1f}" for k, v in plan.components.items() if v)
    verdict = "fits" if plan.fits else "does NOT fit"
    return f"host per node (GB): {parts} => {plan.total / GB:.1f} of {plan.host_memory / GB:g}: {verdict}"


def host_text(plan: HostPlan) -> str:
    kinds = ", ".join(f"{n} {k} rank{'s' if n > 1 else ''}" for k, n in plan.ranks.items())
    lines = [f"{'host memory per node (' + kinds + ')':<60}{'GB':>8}"]
    for name, value in plan.components.items():
        lines.append(f"  {LABELS[name]:<58}{value / GB:>8.1f}")
    lines.append(f"  {'total':<58}{plan.total / GB:>8.1f}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.host_memory > 0:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(
            f"host: {plan.total / GB:.1f} GB per node of {plan.host_memory / GB:g} GB, "
            f"{plan.headroom / GB:.0f} GB kept free: {verdict}"
        )
    breaker = plan.breaker()
    if breaker is not None:
        over = plan.total + plan.headroom - plan.host_memory
        lines.append(
            f"breaks it: {breaker[0]} ({LABELS[breaker[0]]}) {breaker[1] / GB:.1f} GB, the largest part of "
            f"the node's host memory, which is {over / GB:.1f} GB over"
        )
    return "\n".join(lines)


def host_json(plan: HostPlan) -> dict[str, Any]:
    breaker = plan.breaker()
    return {
        "host_memory_gb": plan.host_memory / GB,
        "fits": plan.fits,
        "total_gb": round(plan.total / GB, 2),
        "headroom_gb": round(plan.headroom / GB, 2),
        "ranks": plan.ranks,
        "components": {f"{k}_gb": round(v / GB, 2) for k, v in plan.components.items()},
        "breaking_component": None if breaker is None else {"name": breaker[0], "gb": round(breaker[1] / GB, 2)},
        "notes": plan.notes,
    }
