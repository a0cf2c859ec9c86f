"""The actor: a megatron-core policy at any (TP, PP, VPP, CP, EP, DP) with its optimizer, behind the loop's
`protocols.Actor`.

- `megatron_actor.MegatronActor`: score a batch (behaviour log-probs, the reference's, the teacher's), update on it,
  export weights, hand its state to checkpoints.
- `passes.ActorPasses`: plan -> schedule -> gather, the one way every pass (policy, reference, teacher, routing
  replay's comparison) runs a batch through a model's chunks.
- `packing`: which sequences go to which data-parallel rank and micro-batch, packed end to end into THD streams.
- `chunks`, `optimizer`: the models' chunks with their initial weights; Adam and the LR schedule.
- `teacher`, `router_replay`, `context_parallel`, `gathering`: the distillation teacher, MoE routing replay, the
  CP gather of per-token outputs, results brought to every rank.
- `config.ActorConfig`: its layout, optimizer and memory knobs.

Importing this package imports nothing heavy; `megatron_actor` imports megatron-core.
"""
