"""The actor as its partners see it: small protocols, one per partner's need.

- `WeightSource`: the weights streamed out in the bridge's HF layout (the HF export), and what the engines load after
  each update (the same, or a LoRA adapter alone).
- `AdapterSource`: the actor's LoRA adapter in PEFT's format (the HF export's adapter directory).
- `TrainState`: what a checkpoint saves and restores (the weights' and the optimizer's sharded state, the LR
  schedule), in megatron-core's dist-checkpoint form.
- `EntropyScorer`: the policy's entropy over sampled answers (validation's histogram).
- `Actor`: all of the above plus what the loop itself calls: ``score`` (the `Statistics` the update reads:
  behaviour log-probs, the frozen reference's, the teacher's) and ``update`` (its metrics).

Every method is a collective over the actor's ranks: each rank calls it with the same inputs. No method writes into
what it is given (protocols/handoffs.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from megatron_rlvr.data import PromptItem
from megatron_rlvr.protocols.handoffs import Rollouts, Sequences, Statistics, Targets

WeightBucket = list[tuple[str, torch.Tensor]]  # (HF name, tensor) pairs of one bounded bucket


class WeightSource(Protocol):
    def export_weights(
        self, bucket_bytes: int, include_lm_head: bool = True, lend: bool = False
    ) -> Iterator[WeightBucket]:
        """The weights in HF names and layout (LoRA adapters merged), in buckets of at most ``bucket_bytes``;
        ``lend``: views valid until the next bucket is drawn (bridge/export.py)."""

    def engine_weights(self, bucket_bytes: int, lend: bool = False) -> Iterator[WeightBucket]:
        """What the engines load after an update: ``export_weights``' buckets, or under ``actor.lora.sync:
        adapters`` the adapter alone in PEFT's names (bridge/peft.py), which the engines serve on their base."""


class AdapterSource(Protocol):
    def adapter_config(self) -> dict[str, Any] | None:
        """PEFT's ``adapter_config.json`` of the actor's LoRA adapter; None: no adapter (full fine-tuning)."""

    def export_adapter(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The adapter alone in PEFT's names and layout (a collective over the model-parallel group)."""


class TrainState(Protocol):
    def sharded_state_dict(self, metadata: Mapping[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """megatron-core's sharded state of the trained weights and their optimizer (``metadata``: the optimizer's
        sharding format); ``is_loading``: the request a load fills."""

    def load_sharded_state_dict(self, loaded: Mapping[str, Any]) -> None:
        """Take the weights and optimizer state a dist-checkpoint load returned for `sharded_state_dict`'s request."""

    def scheduler_state_dict(self) -> dict[str, Any]:
        """The LR schedule's position (plain data, saved as JSON)."""

    def load_scheduler_state_dict(self, state: Mapping[str, Any]) -> None: ...


class EntropyScorer(Protocol):
    def compute_entropy(self, sequences: Sequences) -> torch.Tensor:
        """The policy's entropy at every position of ``sequences`` [B, S - 1], on every rank."""


class Actor(WeightSource, AdapterSource, TrainState, EntropyScorer, Protocol):
    def score(self, rollouts: Rollouts, items: Sequence[PromptItem], *, mini_batches: int) -> Statistics:
        """What the update of ``mini_batches`` mini-batches will read besides the rollouts and their targets: the
        behaviour log-probs (None when that update is exactly on-policy and takes its own), the KL reference's,
        the teacher's scores (distillation; ``items`` are the rollouts' prompts, ``len(rollouts) / len(items)``
        rows each; CRPO's teacher also reads the rewards and says which rows form a group with a correct
        response)."""

    def update(
        self, rollouts: Rollouts, targets: Targets, statistics: Statistics, *, mini_batches: int
    ) -> dict[str, float]:
        """One optimizer step per mini-batch; the averaged loss metrics, the same on every rank, with
        ``rollout/logp_mismatch``: the mean |engine log-prob - behaviour log-prob| over the trained tokens (the
        behaviour log-probs are the statistics' or, exactly on-policy, the update's own)."""

    def reset_reference(self) -> None:
        """ARMOR: the frozen reference takes the policy's current weights (needs algo.armor.mixed_ratio_share)."""
