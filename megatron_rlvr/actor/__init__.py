"""The actor: a megatron-core policy at any (TP, PP, VPP, DP) with its optimizer, and what its passes read.

- `batch.SequenceBatch`: rollouts as every pass reads them (the loop's hand-off type; torch only).
- `packing`: which sequences go to which data-parallel rank and micro-batch, packed end to end into THD streams.
- `megatron_actor.MegatronActor`: the statistics, reference and update passes through megatron-core's schedule.
- `config.ActorConfig`: its layout, optimizer and memory knobs.

Importing this package imports nothing heavy; `megatron_actor` imports megatron-core.
"""
