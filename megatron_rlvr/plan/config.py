"""Configuration of the machines a recipe targets, read by `megatron-rlvr plan` (plan/host_memory.py).

Plain data; ``__post_init__`` only checks ranges so a bad recipe fails at load time with the key's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterConfig:
    # host (CPU) memory of one node in GB; the plan refuses a layout whose node total does not fit. 0 = not checked.
    # The H200 recipes assume a DGX H200 node: 2 TB (2000 GB) of system memory.
    host_memory_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.host_memory_gb < 0:
            raise ValueError(f"cluster.host_memory_gb: expected >= 0 (0: not checked), got {self.host_memory_gb!r}")
