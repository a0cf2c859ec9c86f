"""The messages between actor rank 0 and the engine ranks under separate placement, and the protocol they follow.

Member 0 of the cross group is actor rank 0; engine rank 0 replies. A `Command` is broadcast to every engine rank;
"weights" is followed by the weight transfer (rollout/transfer.py); "collect" and "generate" are answered by one
reply each (a `Rollout`, the answers, or a `Failure`); "stop" ends the engine ranks' loop. Streamed
(``rollout.max_staleness >= 2``, stream_server.py): "start" begins the stream (no reply), "take" is answered by a
step's `Rollout` once the admission ledger selects it, "snapshot" by the stream's state for a checkpoint; the engine
ranks read commands between engine steps. At most one request is
outstanding, and its reply is received before the next command goes out (a gloo send waits for its receive, so a
command sent while the engines are sending would deadlock). The transport is runtime/roles.py's object messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.experience.collect import Experience


class EngineRankError(RuntimeError):
    """An engine rank failed, died or went silent; the message names the rank and what happened."""


@dataclass
class Rollout:
    """One step's experience as the engine ranks ship it."""

    step: int
    version: int  # the weight version that sampled it (the actor step whose weights the engines held); streamed: the
    # oldest token's
    loader_after: dict[str, Any]  # the prompt stream's state after this step's draws
    experience: Experience
    seconds: float = 0.0  # the engines' time for it (generation, scoring, refill)


@dataclass
class Command:
    # "weights" | "collect" | "generate" | "stop"; streamed (stream_server.py): "start" | "take" | "snapshot" too
    kind: str
    step: int = 0
    version: int = 0
    loader: dict[str, Any] | None = None
    requests: list[Any] = field(default_factory=list)  # "generate": (prompt ids, n, Sampling) per actor rank
    state: Any = None  # "start": the checkpoint's stream.StreamState to resume, or None
    take: bool = False  # streamed "weights": then take step ``version``'s experience (the step they train)


@dataclass
class Failure:
    """An engine rank's reply when it could not serve a request (it exits afterwards)."""

    rank: int
    what: str
