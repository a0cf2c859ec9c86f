"""CPU-only code, in one place: what makes megatron-core run without CUDA (shims.py, applied only when CUDA is
absent, each shim naming the call site it serves) and the packed-sequence core attention used where Transformer
Engine is not installed (attention.py, picked by the layer-spec builder). No other module knows these exist.
"""
