"""What the wings hand each other, declared once: the hand-offs of a training step (`Rollouts` -> `Targets` ->
`Statistics` -> the update's metrics) and the protocols the loop and its partners (experience sources,
checkpoints, validation) need of the actor.

This package sits low in the layers (above data, below actor): the actor implements the protocols, the loop and the
partners are typed with them, and nobody reaches into the actor's insides. Importing it imports torch and nothing
heavy.
"""

from megatron_rlvr.protocols.actor import Actor, AdapterSource, EntropyScorer, TrainState, WeightSource
from megatron_rlvr.protocols.handoffs import ContextGroups, Rollouts, Sequences, Statistics, Targets

__all__ = [
    "Actor",
    "AdapterSource",
    "ContextGroups",
    "EntropyScorer",
    "Rollouts",
    "Sequences",
    "Statistics",
    "Targets",
    "TrainState",
    "WeightSource",
]
