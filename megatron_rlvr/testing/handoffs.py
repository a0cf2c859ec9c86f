"""The step's hand-offs (protocols/handoffs.py) made by hand for tests and benchmarks, and a check that nothing was
written into them.

- ``rollouts(tokens, mask, ...)``: a `Rollouts` whose engine log-probs and rewards default to 0;
- ``versions(*handoffs)`` / ``assert_untouched(before, *handoffs)``: the version counter of every tensor of the given
  hand-offs (nested ones included); torch bumps a tensor's counter on every in-place write, through any view of its
  storage, so equal counters mean nothing wrote into them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rlvr.protocols.handoffs import Rollouts


def rollouts(
    tokens: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    engine_logp: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> Rollouts:
    """``Rollouts`` of ``tokens`` [B, S] with ``response_mask`` [B, S - 1]; engine log-probs and rewards 0 unless
    given."""
    b = tokens.shape[0]
    return Rollouts(
        tokens=tokens,
        response_mask=response_mask,
        routed_experts=routed_experts,
        engine_logp=torch.zeros(response_mask.shape) if engine_logp is None else engine_logp,
        rewards=torch.zeros(b) if rewards is None else rewards,
    )


def _tensors(value: Any, name: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {name: value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        found: dict[str, torch.Tensor] = {}
        for f in dataclasses.fields(value):
            found |= _tensors(getattr(value, f.name), f"{name}.{f.name}")
        return found
    return {}


def versions(*handoffs: Any) -> dict[str, int]:
    """``"<type>.<field>" -> version counter`` of every tensor of ``handoffs``."""
    found: dict[str, int] = {}
    for h in handoffs:
        found |= {k: t._version for k, t in _tensors(h, type(h).__name__).items()}
    return found


def assert_untouched(before: dict[str, int], *handoffs: Any) -> None:
    """Every tensor of ``handoffs`` has the version counter ``before`` recorded: nothing wrote into it."""
    after = versions(*handoffs)
    written = sorted(k for k in before if after.get(k) != before[k])
    if written:
        raise AssertionError("written after they were handed over: " + ", ".join(written))
