"""What the wings hand each other, declared once: the loop's hand-off type (`SequenceBatch`) and the protocols the
loop and its partners (experience sources, checkpoints, validation) need of the actor.

This package sits low in the layers (above data, below actor): the actor implements the protocols, the loop and the
partners are typed with them, and nobody reaches into the actor's insides. Importing it imports torch and nothing
heavy.
"""

from megatron_rlvr.protocols.actor import Actor, AdapterSource, EntropyScorer, TrainState, WeightSource
from megatron_rlvr.protocols.batch import SequenceBatch

__all__ = ["Actor", "AdapterSource", "EntropyScorer", "SequenceBatch", "TrainState", "WeightSource"]
