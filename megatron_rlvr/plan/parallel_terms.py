"""The plan's terms for mixture-of-experts layers and context parallelism (docs/plan.md, docs/moe.md), as pure
arithmetic of (ModelDims, Layout); plan/actor_terms.py and plan/memory.py add them into a rank's components.

Mixture-of-experts (megatron-core 0.16's MoE layer: router, all-to-all token dispatcher, SequentialMLP experts):

- an MoE layer's router keeps, per token entering it, the fp32 logits and probabilities over every expert and the
  boolean routing map;
- the all-to-all dispatcher permutes ``top_k`` copies of each token's hidden state by expert, exchanges them over EP
  and all-gathers them over ETP, so one rank's experts see ``tokens x top_k x etp`` rows when the routing is
  balanced (tokens: this rank's share of the micro-batch, 1/tp of it with sequence parallelism);
- each row keeps, for backward, the expert's fc1 input (hidden), its fc1 output (2 x ffn / etp), silu(gate), the
  SwiGLU product and the product scaled by the routing probability (ffn / etp each), and the fp32 probability;
- while one MoE layer runs (forward or backward) the dispatcher holds its buffers: the permuted copies and what the
  all-to-all returns (``tokens x top_k`` rows each), the ETP-gathered rows and their expert-sorted copy
  (``tokens x top_k x etp`` rows each), of hidden values: `dispatcher_bytes`.

Context parallelism (cp > 1): each CP rank holds 1/cp of every sequence's tokens (``Layout.micro_tokens`` is already
per CP rank), so everything per token divides by cp. Attention is over whole sequences: the layer being computed
gathers the K and V of every token of the micro-batch over the CP group, `cp_kv_bytes`, a one-layer working set.

Unbalanced routing puts more rows on some ranks than the mean counted here; RL fine-tunes a router pretraining
balanced, so the mean is the estimate (named: ROUTING_IMBALANCE).
"""

from __future__ import annotations

from typing import Protocol

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.plan.units import FP32


class Layout(Protocol):
    """What these terms read of plan/memory.py's Layout (declared here: memory.py imports this module)."""

    tp: int
    dp: int
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    micro_tokens: int
    param_bytes: int


# Rows one rank's experts receive over the balanced mean: 1.0 counts the mean (an estimate, not measured on a GPU).
ROUTING_IMBALANCE = 1.0


def layer_tokens(lay: Layout) -> int:
    """Tokens of one micro-batch entering a layer's MLP on this rank (sequence parallelism cuts them over TP)."""
    return lay.micro_tokens // (lay.tp if lay.sequence_parallel else 1)


def expert_rows(dims: ModelDims, lay: Layout) -> int:
    """Rows the local experts compute for one micro-batch: top_k copies of the layer's tokens, all-to-all'd over EP
    (the mean is the rank's own count) and gathered over ETP."""
    return int(layer_tokens(lay) * dims.experts_per_token * lay.etp * ROUTING_IMBALANCE)


def moe_mlp_saved_bytes(dims: ModelDims, lay: Layout) -> int:
    """What an MoE layer's router and experts keep for backward for one micro-batch (the attention half of the
    layer is the dense layer's, in plan/actor_terms.py)."""
    e = lay.param_bytes
    router = layer_tokens(lay) * dims.experts * (2 * FP32 + 1)  # fp32 logits and probabilities, routing map
    per_row = (dims.hidden + 5 * dims.expert_ffn // lay.etp) * e + FP32
    return router + expert_rows(dims, lay) * per_row


def dispatcher_bytes(dims: ModelDims, lay: Layout) -> int:
    """The all-to-all dispatcher's buffers while one MoE layer runs (0 for a dense model): the permuted copies and
    the all-to-all's output, then the ETP-gathered rows and their expert-sorted copy, hidden values each."""
    if not dims.is_moe:
        return 0
    local_copies = layer_tokens(lay) * dims.experts_per_token
    return (2 * local_copies + 2 * expert_rows(dims, lay)) * dims.hidden * lay.param_bytes


def cp_kv_bytes(dims: ModelDims, lay: Layout) -> int:
    """K and V of every token of one micro-batch (all CP ranks' tokens), this rank's heads: what one attention
    layer gathers over the CP group (0 without context parallelism)."""
    if lay.cp <= 1:
        return 0
    return lay.micro_tokens * lay.cp * 2 * dims.kv_width // lay.tp * lay.param_bytes


def expert_shard_ranks(lay: Layout) -> int:
    """The expert-data-parallel size: ranks holding the same experts, over which the distributed optimizer shards
    the expert state ((dp x tp x cp) / (ep x etp))."""
    return max(1, lay.dp * lay.tp * lay.cp // (lay.ep * lay.etp))
