"""Experience: what the loop trains on, and where it comes from.

- `collect`: prompts -> sampled responses -> rewards -> group advantages -> one `Experience` (a whole step: its
  `Rollouts` and `Targets`).
- `source`: the `ExperienceSource` protocol the trainer holds, and `make_source` for ``rollout.placement``.
- `colocated`: every rank samples with its own engine, then trains (they take turns).
- `engine_ranks`: the actor side of separate placement (engines on ranks of their own, one-step-off, streamed).
- `engine_server`: the engine ranks' side: serve the actor's commands.
- `admission`, `stream`, `stream_server`: fully asynchronous training (``rollout.max_staleness >= 2``): the staleness
  bound by admission, one engine rank's stream, and the engine ranks' loop around it.
- `wire`: the messages between the two sides.
- `validation`: sampling on the actor's behalf (val/pass@k).
- `transforms`: the registry of the algorithms' experience transforms; `methods/`: the transforms (ARMOR's
  anchors, SFT's demonstrations, PBA's per-sequence KL), one module each.
"""
