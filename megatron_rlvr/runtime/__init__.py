"""The runtime every rank stands on: process groups and megatron-core's parallel state (distributed.py), the
split of one torchrun world into actor and engine ranks with their object messages (roles.py), preemption on a
cluster's signal (preemption.py: the ranks' side; stop_relay.py: the launcher's), and what the console shows
(console.py).

`runtime.cpu` holds everything that exists only so megatron-core runs without CUDA or Transformer Engine.
"""
