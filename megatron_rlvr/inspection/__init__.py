"""Inspection: command-line studies of a model's or a loss's behaviour, apart from the training path.

- `candidates`: per response token, the top-N candidates of one or more models as one heatmap
  (`megatron-rlvr candidates`).
- `toy_tree`: the didactic tree MDP of the CaSP paper, trained through the project's own losses
  (`megatron-rlvr toy-tree`).
- `probe*`: the fixed probe (`megatron-rlvr probe`): a probe set of the base's own responses (probe_set, probe_draw),
  scored teacher-forced with any checkpoint at any TP x PP (probe_stats, probe_scoring), summed per prompt into a
  small results file (probe_summary) and drawn (probe_figure).
- `mechanism_*`: the CaSP mechanism study (docs/casp-mechanism.md): its design, the intervals and verdict rule, the
  results folder's reader, the report and its figures.

Nothing in the training path imports this package.
"""
