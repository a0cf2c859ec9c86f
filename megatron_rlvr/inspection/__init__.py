"""Inspection: command-line studies of a model's or a loss's behaviour, apart from the training path.

- `candidates`: per response token, the top-N candidates of one or more models as one heatmap
  (`megatron-rlvr candidates`).
- `toy_tree`: the didactic tree MDP of the CaSP paper, trained through the project's own losses
  (`megatron-rlvr toy-tree`).

Nothing in the training path imports this package.
"""
