"""Commands that read a whole recipe for a wing below the config layer. Such a wing cannot read a recipe itself:
config.py composes its section, so the wing may not import config.py. `megatron-rlvr estimate` (estimate.py) reads
an eval recipe here and hands it to eval's arithmetic (eval/estimate.py).
"""
