"""Host memory per node of a recipe's layout, as pure arithmetic of (Config, HF config, nodes): the plan's second
table, beside the per-GPU one (plan/memory.py). Nothing here imports torch.

Per rank, from what this project's code allocates in host memory (docs/weight-sync.md):
- staging (``rollout.sync_staging: full``): the engine rank's shard of the weight stream, checked whole and kept
  until the commit (rollout/shard_stage.py): HF bytes / engine TP + the replicated norms. "streaming": none. With
  ``actor.lora.sync: adapters`` the stream is the adapter alone, kept whole (rollout/lora_adapters.py). On CPU
  with fresh tensors (actor TP 1, PP > 1, separate placement) the in-process engine's direct loader keeps a second
  buffer of every weight instead (rollout/cpu/weights.py): the model's bytes, held from the second sync on; with lent
  tensors (colocated, actor TP > 1, PP 1, a dense model) it stages nothing: the stream stays in the export's slot.
- sleep-mode offload (colocated GPU engines): level 1 moves the engine's weights to host memory while the actor
  trains (HF bytes / engine TP per rank); level 2 drops them (re-sent at the next sync): none.
- transfer buckets, in /dev/shm, i.e. host RAM (the pages a sync touches): the export's shared-memory exchange (two
  slots per TP rank, each at least SHM_SLOT_BYTES or the largest TP shard) and its lending slots. Device parameters
  (GPU) lend in two rounds of at most ``rollout.bucket_bytes``; host parameters (CPU) lend in two whole-call slots,
  one whole model each, in TP rank 0's segment (bridge/export_lending.py, bridge/lent_slots.py), which the engines compute on.
- the reward pool, per rank (every rank runs one): ``reward.workers`` x (the code sandbox's memory budget +
  its tmpfs) for code, else workers x a verifier process's resident set (an estimate, below).
- the data loader: every rank holds the tokenized train split (an estimate from the row count and prompt length).
- the rank's own process: Python, torch, megatron-core, vLLM, the CUDA host-side runtime (an estimate on GPU; on
  CPU measured on this machine); the node's launcher (torchrun), once per node.
- fully asynchronous training (``rollout.max_staleness`` k >= 2, docs/async.md): engine rank 0 keeps every group the
  admission bound lets in, finished or in flight, as Python lists (token ids, log-probs, weight versions): at most
  (k + 1) x ``trainer.prompts_per_step`` x ``rollout.group_size`` responses of up to ``rollout.max_new_tokens``
  tokens (an estimate per token, below), counted on the fullest node once.
- on CPU only, the actor and the engine themselves live in host memory (plan/memory.py's CPU arithmetic for the
  actor; the engine's fp32 weights and its ``kv_cache_memory_bytes``), and the end-of-run HF export
  (``trainer.save_hf``: fresh buckets on every rank; not counted on GPU, where the buckets are on the device
  and rank 0's serialization copies one of at most ``rollout.bucket_bytes`` to the host, small beside a node).

On CPU with lent tensors the node's peak is the larger of two moments (`host_plan` notes which): the first sync,
when one slot is written while every engine still holds the weights vLLM loaded, and the later syncs through the end-of-run
export, when both slots are written and the engines hold only their plain parameters.

A node fits when the sum over its ranks stays within ``cluster.host_memory_gb`` less HOST_HEADROOM_FRACTION (the
OS, page cache, the container). Sizes in bytes; GB = 10^9 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.lora_terms import adapter_hf_params
from megatron_rlvr.plan.memory import FP32, GB, Layout, actor_rank_plan

# Assumptions not measured here (GPU nodes), named:
GPU_RANK_PROCESS_BYTES = int(8.0 * GB)  # one GPU rank's process: CUDA host runtime, NCCL, torch, megatron, vLLM
# one verifier worker: measured 53 MB PSS once started (Python + math_verify + sympy imported, this machine); twice
# that for what sympy caches while it scores
VERIFIER_RESIDENT_BYTES = int(0.1 * GB)
DATA_ROW_OVERHEAD_BYTES = 2048  # one prompt row's Python objects beyond its token ids (text, answer, id, dict)
BYTES_PER_TOKEN_ID = 36  # a token id in a Python list: the 8-byte slot and a 28-byte int object
DEFAULT_DATA_ROWS = 100_000  # rows assumed when the data file is not readable here
# a streamed response's token on engine rank 0: its id (36, as above), its log-prob (an 8-byte slot and a 24-byte
# float object), its weight version (a slot; small ints are shared) and ~4 bytes of text
BYTES_PER_STREAMED_TOKEN = 80
HOST_HEADROOM_FRACTION = 0.10
# Measured on this project's CPU machine: one process's PSS after importing torch, megatron-core, the trainer and
# vLLM and starting a vLLM engine for the demo model, less the engine's weights and KV cache (0.50 GB; alone in its
# process, so the shared libraries count whole: ranks that share them count less each).
CPU_RANK_PROCESS_BYTES = int(0.5 * GB)
# the node's launcher (torchrun's agent: Python + torch.distributed imported): measured 157 MB PSS on this machine
LAUNCHER_BYTES = int(0.16 * GB)
SHM_SLOT_BYTES = 64 << 20  # bridge/export_plan.py: the exchange's per-rank slot (at least the largest TP shard)

LABELS = {
    "staging": "staged weight shard (sync)",
    "sleep_offload": "sleep-mode offload",
    "transfer_buckets": "transfer buckets (/dev/shm)",
    "reward_pool": "reward pool",
    "data_loader": "data loader (estimate)",
    "process": "rank processes (estimate)",
    "launcher": "launcher (torchrun)",
    "stream_buffer": "streamed responses, k + 1 steps (estimate)",
    "actor": "actor (CPU)",
    "engine": "engine weights + KV (CPU)",
    "hf_export": "end-of-run HF export (CPU)",
}
CPU_ONLY = ("actor", "engine", "hf_export")
VLLM_VOCAB_PADDING = 64  # vLLM pads its embedding and lm_head rows to a multiple of this (VocabParallelEmbedding)


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


def _exchange_bytes(dims: ModelDims, lay: Layout) -> int:
    """One actor rank's touched exchange slots (TP > 1): two, each the larger of SHM_SLOT_BYTES and its largest
    shard, filled at most with its share of the model (the gather of every call that does not lend)."""
    model = dims.hf_params() * lay.param_bytes
    slot = max(SHM_SLOT_BYTES, max(dims.vocab * dims.hidden, 2 * dims.ffn * dims.hidden) // lay.tp * lay.param_bytes)
    return 2 * min(slot, model // lay.tp)


def lends_whole_calls(dims: ModelDims, lay: Layout) -> bool:
    """Whether the export lends in whole-call slots: parameters in host memory (CPU), TP > 1 on one host, PP 1, and
    no experts laid out apart (their gather is not lent: such a call lends nothing). bridge/export_lending.py."""
    return not lay.gpu and lay.tp > 1 and lay.pp == 1 and not dims.is_moe


def transfer_bucket_bytes(dims: ModelDims, lay: Layout, slots_written: int = 2) -> int:
    """One actor rank's touched /dev/shm (only with actor TP > 1): its exchange slots and its share of the lending
    slots in TP rank 0's segment (the TP ranks share those pages, so each counts 1/TP). Device parameters lend in two
    rounds of at most ``rollout.bucket_bytes``; host parameters in whole-call slots, one whole model each, of which
    ``slots_written`` have been written (the first sync writes one, every later sync alternates between two)."""
    if lay.tp == 1:
        return 0
    model = dims.hf_params() * lay.param_bytes
    if lends_whole_calls(dims, lay):
        return _exchange_bytes(dims, lay) + slots_written * model // lay.tp
    if not lay.gpu and (lay.pp > 1 or dims.is_moe):  # the export lends nothing here: the exchange's gather only
        return _exchange_bytes(dims, lay)
    slot = max(SHM_SLOT_BYTES, max(dims.vocab * dims.hidden, 2 * dims.ffn * dims.hidden) // lay.tp * lay.param_bytes)
    return _exchange_bytes(dims, lay) + 2 * min(lay.bucket_bytes, lay.tp * slot, model) // lay.tp


def engine_plain_bytes(dims: ModelDims) -> int:
    """What an in-process CPU engine fed lent tensors keeps of its own after its first commit (rollout/cpu/weights.py):
    its GEMM weights are views of the held slot (vLLM's packed handles are dropped); every plain parameter adopted as
    a view keeps the tensor vLLM loaded as its twin; those it cannot adopt (the packed q/k/v biases, and the tables
    when vLLM pads the vocabulary) keep the live tensor and a twin."""
    tables = dims.vocab * dims.hidden * (1 if dims.tied else 2)
    norms = _norm_values(dims) + (2 * dims.layers * dims.head_dim if dims.qk_norm else 0)
    biases = dims.layers * (dims.q_width + 2 * dims.kv_width) if dims.qkv_bias else 0
    never_adopted = biases + (tables if dims.vocab % VLLM_VOCAB_PADDING else 0)
    return (tables + norms + biases + never_adopted) * FP32


def hf_export_bytes(dims: ModelDims, lay: Layout) -> int:
    """One rank's end-of-run HF export on CPU (checkpoint/store.py save_hf, fresh tensors on every rank of the
    model-parallel group): the bucket being filled and the one the loop still holds, each at most
    ``rollout.bucket_bytes`` (the model when smaller; one tensor when it is larger)."""
    largest = max(dims.vocab * dims.hidden, 2 * dims.ffn * dims.hidden) * FP32
    return 2 * max(min(lay.bucket_bytes, dims.hf_params() * FP32), largest)


def stream_buffer_bytes(cfg: Any) -> int:
    """Engine rank 0's groups under fully asynchronous training: (k + 1) steps of responses at the answer budget."""
    r = cfg.rollout
    responses = (r.max_staleness + 1) * cfg.trainer.prompts_per_step * r.group_size
    return responses * r.max_new_tokens * BYTES_PER_STREAMED_TOKEN


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
    c = dict.fromkeys(LABELS if not lay.gpu else [k for k in LABELS if k not in CPU_ONLY], 0)
    process = GPU_RANK_PROCESS_BYTES if lay.gpu else CPU_RANK_PROCESS_BYTES
    full = r.sync_staging == "full"
    # CPU, colocated, lent tensors: the engines compute on the held lending slot and stage nothing of their own
    adopts = lends_whole_calls(dims, lay) and lay.placement != "separate" and full
    model = engine_weight_bytes(dims, 1, FP32)
    first: dict[str, int] = {}  # adopts: the first sync's moment, where it differs from the later one (in ``c``)
    c["launcher"] = LAUNCHER_BYTES
    for kind, count in kinds.items():
        has_engine = kind in ("colocated", "engine")
        has_actor = kind in ("colocated", "actor")
        c["process"] += count * process
        c["reward_pool"] += count * reward_pool_bytes(cfg)
        c["data_loader"] += count * data_loader_bytes(cfg)
        if has_actor:
            c["transfer_buckets"] += count * transfer_bucket_bytes(dims, lay)
        if has_engine and lay.lora_rank and lay.lora_sync == "adapters":  # the adapter alone, checked whole
            c["staging"] += count * adapter_hf_params(dims, lay.lora_rank, lay.lora_targets) * value_bytes
        elif has_engine and full and not adopts:
            # GPU: the staged shard; CPU with fresh tensors: the direct loader's second buffer (or, for a model it
            # does not cover, vLLM's reload behind the shard stage at TP 1): the model's bytes
            c["staging"] += count * (staged_bytes(dims, engine_tp, value_bytes) if lay.gpu else model)
        if has_engine and lay.gpu and kind == "colocated" and lay.sleep_level == 1:
            c["sleep_offload"] += count * engine_weight_bytes(dims, engine_tp, value_bytes)
        if not lay.gpu:
            if has_actor:
                actor = actor_rank_plan(dims, lay, 0, 0)
                c["actor"] += count * actor.peak
                if cfg.trainer.save_hf:
                    c["hf_export"] += count * hf_export_bytes(dims, lay)
            if has_engine:
                kv = r.kv_cache_memory_bytes
                c["engine"] += count * ((engine_plain_bytes(dims) if adopts else model) + kv)
                if adopts:  # the first sync: the weights vLLM loaded are live until its commit, one slot written
                    first["engine"] = first.get("engine", 0) + count * (model + kv)
                    first["transfer_buckets"] = first.get("transfer_buckets", 0) + count * model // lay.tp
    if kinds.get("engine") and lay.max_staleness >= 2:
        c["stream_buffer"] = stream_buffer_bytes(cfg)
    moment = ""
    if first:
        # the exchange is first touched, and the HF export runs, only after the first sync
        first_total = sum(c.values()) - c["engine"] - c["transfer_buckets"] - c["hf_export"] + sum(first.values())
        if first_total > sum(c.values()):
            c.update(first, hf_export=0)
            moment = "the first weight sync (one lending slot written, the engines' loaded weights still live)"
        else:
            moment = "a later weight sync or the end-of-run HF export (both lending slots written)"
    host = int(host_memory_gb * GB)
    notes = []
    if moment:
        notes.append(f"the peak is at {moment}")
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
    """The host plan in one recipe-header line (tests/unit/plan checks every H200 recipe carries its current one)."""
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
