"""`megatron-rlvr plan --suggest`: the layouts that fit on the given nodes, best first.

Varied: actor TP (sequence parallel on whenever TP > 1), actor PP, the micro-batch's tokens (1, 2 or 4 of the
recipe's longest sequences), engine TP, and gpu_memory_utilization (0.30 to 0.90 in steps of 0.05: for each of the
others the largest share that fits, i.e. the biggest KV cache). Kept as in the recipe: recompute, dtype, optimizer.

The order (RANKING_RULE) prefers, in turn: fewer GPUs per actor replica (TP x PP: more data parallelism, less
model-parallel communication), fewer pipeline stages (no bubbles), more sequences of rollout.max_model_len that
all engines' KV caches hold together (generation dominates an RLVR step), more tokens per micro-batch (fewer
passes), fewer GPUs per engine (more engine replicas).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_rlvr.plan.memory import Layout, Plan, kv_tokens, plan_layout
from megatron_rlvr.plan.model_dims import ModelDims

RANKING_RULE = (
    "fewer GPUs per actor replica (TP x PP), then fewer pipeline stages, then more KV-cache sequence "
    "slots over all engines, then more micro-batch tokens, then fewer GPUs per engine"
)
UTILIZATIONS = tuple(round(0.30 + 0.05 * i, 2) for i in range(13))
TOKEN_MULTIPLES = (4, 2, 1)


@dataclass
class Suggestion:
    layout: Layout
    plan: Plan
    sequence_slots: int  # sequences of rollout.max_model_len the KV caches of all engines hold at once

    def overrides(self, has_token_budget: bool) -> list[str]:
        """The `key=value` overrides that turn the recipe into this layout."""
        lay = self.layout
        out = [f"actor.tp={lay.tp}", f"actor.pp={lay.pp}", f"actor.sequence_parallel={str(lay.tp > 1).lower()}"]
        if has_token_budget:
            out.append(f"actor.max_tokens_per_micro_batch={lay.micro_tokens}")
        else:
            out.append(f"actor.micro_batch_size={lay.micro_tokens // lay.max_seq_len}")
        out += [f"rollout.tp={lay.engine_tp}", f"rollout.gpu_memory_utilization={lay.gpu_memory_utilization}"]
        return out


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(dims: ModelDims, base: Layout, world: int, gpus_per_node: int) -> list[Layout]:
    """Every (TP, PP, micro tokens, engine TP) megatron-core and vLLM accept on ``world`` GPUs, at the recipe's
    other settings; TP and engine TP stay inside a node (NVLink)."""
    heads = math.gcd(dims.heads, dims.kv_heads)
    tps = _divisors(heads, gpus_per_node)
    mini_batch_tokens = base.micro_batches * base.micro_tokens * base.dp  # the recipe's, about
    out = []
    for tp in tps:
        for pp in _divisors(dims.layers, world):
            if world % (tp * pp):
                continue
            for k in TOKEN_MULTIPLES:
                tokens = k * base.max_seq_len
                for etp in tps:
                    if world % etp:
                        continue
                    dp = world // (tp * pp)
                    micro_batches = max(1, math.ceil(mini_batch_tokens / dp / tokens))
                    out.append(
                        dataclasses.replace(
                            base,
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            sequence_parallel=tp > 1,
                            micro_tokens=tokens,
                            micro_batches=micro_batches,
                            engine_tp=etp,
                        )
                    )
    return out


def _rank(s: Suggestion) -> tuple:
    lay = s.layout
    return (lay.tp * lay.pp, lay.pp, -s.sequence_slots, -lay.micro_tokens, lay.engine_tp)


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
    for lay in candidate_layouts(dims, base, world, gpus_per_node):
        for util in sorted(UTILIZATIONS, reverse=True):
            trial = dataclasses.replace(lay, gpu_memory_utilization=util)
            plan = plan_layout(dims, trial, gpu_memory_gb, headroom_gb)
            if plan.fits:
                found.append(Suggestion(trial, plan, sequence_slots(dims, plan, world)))
                break
    return sorted(found, key=_rank)
