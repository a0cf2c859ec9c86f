"""megatron-rlvr: reinforcement learning with verifiable rewards on megatron-core, with CaSP.

Importing the package is cheap: heavy dependencies (megatron.core, vllm) are imported by the modules that need them.
"""

__version__ = "0.1.0"
