"""The one rollout protocol: every engine (vLLM on GPU, vLLM on CPU, test fakes) implements `RolloutEngine`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class Sampling:
    """How to sample; `n` responses per prompt is passed to `generate` beside it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # no end (EOS, stop string) before this many tokens: fixes the length of answers for benchmarks (vLLM min_tokens)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True  # return the sampled token's log-prob per generated token


@dataclass
class Completion:
    """One sampled response: generated token ids (prompt excluded), their log-probs under the engine, and text.

    ``prefix_len``: the first ``prefix_len`` entries of ``token_ids`` (and of ``logprobs``) were written by a weaker
    model (rollout/prefixes.py): context for the policy, never trained; the rest is the engine's own continuation.

    ``routed_experts``: MoE engines that capture their routing: [prompt + response tokens, MoE layers, top_k] expert
    ids, the experts each token of the sequence went to (what ``actor.router_replay: rollout`` replays). The last
    token's row is -1 where the engine never ran it through the model (vLLM: the last sampled token, whose routing
    affects no log-prob of the sequence); rollout/routed_experts.py."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prefix_len: int = 0
    routed_experts: torch.Tensor | None = None


class EngineDiedError(RuntimeError):
    """The engine process or its in-process state is gone; the trainer rebuilds it from the actor's weights."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine is to the rest of the system; nothing reads an engine beyond this."""

    # how many ranks drive this engine together (its generate is a collective over them); None: the colocated
    # rollout.tp ranks of the recipe
    ranks_per_engine: int | None

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], lent: bool = False) -> None:
        """Load a stream of (HF parameter name, tensor) into the engine's model. ``lent``: a tensor is valid only
        until the engine draws the next bucket of the stream (the bridge's ``lend=True``); copy what must outlive it."""

    def sleep(self) -> None:
        """Free the engine's accelerator memory (weights and KV cache) while the actor trains."""

    def wake(self) -> None:
        """Undo `sleep`."""

    @property
    def alive(self) -> bool:
        """False once the engine died (it raised `EngineDiedError`); the caller rebuilds it."""

    def close(self) -> None:
        """Release the engine now (not from ``__del__`` at interpreter exit). Idempotent."""
