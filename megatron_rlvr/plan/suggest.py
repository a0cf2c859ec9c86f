"""`megatron-rlvr plan --suggest`: the layouts that fit on the given nodes, best first.

Varied: actor TP (sequence parallel on whenever TP > 1), actor PP, context parallelism CP (1, 2, 4, 8 inside a
node, only when the recipe's longest sequence has at least LONG_SEQUENCE_TOKENS tokens), expert parallelism EP (a
MoE model: the divisors of its experts that divide dp x tp x cp / etp, up to a node), the micro-batch's tokens (1,
2 or 4 of the recipe's longest sequences, per CP rank), engine TP, and gpu_memory_utilization (0.30 to 0.90 in
steps of 0.05: for each of the others the largest share that fits, i.e. the biggest KV cache). Kept as in the
recipe: ETP, recompute, dtype, optimizer.

The order (RANKING_RULE) prefers, in turn: fewer GPUs per actor replica (TP x PP x CP: more data parallelism,
less model-parallel communication), fewer pipeline stages (no bubbles), for long sequences (CP searched) less TP
and so more CP at that replica size (TP's per-layer collectives move every token's hidden state, CP's only its
K/V: hidden / kv_width times less, 7x for Qwen2.5-7B), more sequences of rollout.max_model_len
that all engines' KV caches hold together (generation dominates an RLVR step), fewer expert-parallel ranks (less
all-to-all traffic), more tokens per micro-batch (fewer passes), fewer GPUs per engine (more engine replicas).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.engine_terms import kv_tokens
from megatron_rlvr.plan.memory import Layout, Plan, plan_layout

RANKING_RULE = (
    "fewer GPUs per actor replica (TP x PP x CP), then fewer pipeline stages, then (long sequences) less TP, then "
    "more KV-cache sequence "
    "slots over all engines, then fewer EP ranks, then more micro-batch tokens, then fewer GPUs per engine"
)
# below this longest-sequence length CP is not searched: one sequence's activations fit a TP group (docs/plan.md)
LONG_SEQUENCE_TOKENS = 16384
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)
UTILIZATIONS = tuple(round(0.30 + 0.05 * i, 2) for i in range(13))
TOKEN_MULTIPLES = (4, 2, 1)


@dataclass
class Suggestion:
    layout: Layout
    plan: Plan
    sequence_slots: int  # sequences of rollout.max_model_len the KV caches of all engines hold at once
    varied_cp: bool = False  # the search varied CP (long sequences): always name it
    varied_ep: bool = False  # the search varied EP (a MoE model)

    def overrides(self, has_token_budget: bool) -> list[str]:
        """The `key=value` overrides that turn the recipe into this layout."""
        lay = self.layout
        out = [f"actor.tp={lay.tp}", f"actor.pp={lay.pp}", f"actor.sequence_parallel={str(lay.tp > 1).lower()}"]
        if self.layout.cp > 1 or self.varied_cp:
            out.append(f"actor.cp={lay.cp}")
        if self.layout.ep > 1 or self.varied_ep:
            out.append(f"actor.ep={lay.ep}")
        if has_token_budget:
            out.append(f"actor.max_tokens_per_micro_batch={lay.micro_tokens}")
        else:
            out.append(f"actor.micro_batch_size={lay.micro_tokens * lay.cp // lay.max_seq_len}")
        out += [f"rollout.tp={lay.engine_tp}", f"rollout.gpu_memory_utilization={lay.gpu_memory_utilization}"]
        return out


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def context_parallel_sizes(base: Layout, gpus_per_node: int) -> list[int]:
    """The CP sizes searched: 1, and for long sequences 2..8 inside a node."""
    if base.max_seq_len < LONG_SEQUENCE_TOKENS:
        return [base.cp]
    return sorted({base.cp, *(c for c in CONTEXT_PARALLEL_SIZES if c <= gpus_per_node)})


def expert_parallel_sizes(dims: ModelDims, base: Layout, pool: int, gpus_per_node: int) -> list[int]:
    """The EP sizes searched for ``pool`` = dp x tp x cp ranks: divisors of the experts that divide pool / etp,
    inside a node (the recipe's EP for a dense model, i.e. 1)."""
    if not dims.is_moe:
        return [base.ep]
    if pool % base.etp:
        return []
    return [ep for ep in _divisors(dims.experts, gpus_per_node) if (pool // base.etp) % ep == 0]


def candidate_layouts(dims: ModelDims, base: Layout, world: int, gpus_per_node: int) -> list[Layout]:
    """Every (TP, PP, CP, EP, micro tokens, engine TP) megatron-core and vLLM accept on ``world`` GPUs, at the
    recipe's other settings; TP, CP, EP and engine TP stay inside a node (NVLink)."""
    heads = math.gcd(dims.heads, dims.kv_heads)
    tps = _divisors(heads, gpus_per_node)
    mini_batch_tokens = base.micro_batches * base.micro_tokens * base.dp * base.cp  # the recipe's, about
    out = []
    for tp in tps:
        for pp in _divisors(dims.layers, world):
            for cp in context_parallel_sizes(base, gpus_per_node):
                if world % (tp * pp * cp) or tp * cp > gpus_per_node:
                    continue
                dp = world // (tp * pp * cp)
                for ep in expert_parallel_sizes(dims, base, dp * tp * cp, gpus_per_node):
                    for k in TOKEN_MULTIPLES:
                        tokens = k * math.ceil(base.max_seq_len / cp)  # per CP rank
                        micro_batches = max(1, math.ceil(mini_batch_tokens / dp / cp / tokens))
                        for engine_tp in tps:
                            if world % engine_tp:
                                continue
                            out.append(
                                dataclasses.replace(
                                    base,
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    cp=cp,
                                    ep=ep,
                                    sequence_parallel=tp > 1,
                                    micro_tokens=tokens,
                                    micro_batches=micro_batches,
                                    engine_tp=engine_tp,
                                )
                            )
    return out


def _rank(s: Suggestion) -> tuple:
    lay = s.layout
    tp = lay.tp if s.varied_cp else 0
    return (lay.tp * lay.pp * lay.cp, lay.pp, tp, -s.sequence_slots, lay.ep, -lay.micro_tokens, lay.engine_tp)


def sequence_slots(dims: ModelDims, plan: Plan, world: int) -> int:
    """Sequences of rollout.max_model_len that the KV caches of all engines hold together."""
    lay = plan.layout
    engines = (lay.engine_ranks if lay.placement == "separate" else world) // lay.engine_tp
    kv = max(r.components.get("kv_cache", 0) for r in plan.ranks)
    return engines * (kv_tokens(dims, lay, kv) // lay.max_seq_len)


def suggest(
    dims: ModelDims,
    base: Layout,
    world: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    headroom_gb: float | None = None,
) -> list[Suggestion]:
    """The fitting layouts, best first by RANKING_RULE; for each the largest gpu_memory_utilization that fits."""
    found = []
    varied_cp = len(context_parallel_sizes(base, gpus_per_node)) > 1
    for lay in candidate_layouts(dims, base, world, gpus_per_node):
        for util in sorted(UTILIZATIONS, reverse=True):
            trial = dataclasses.replace(lay, gpu_memory_utilization=util)
            plan = plan_layout(dims, trial, gpu_memory_gb, headroom_gb)
            if plan.fits:
                found.append(Suggestion(trial, plan, sequence_slots(dims, plan, world), varied_cp, dims.is_moe))
                break
    return sorted(found, key=_rank)
