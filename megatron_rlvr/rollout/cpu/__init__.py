"""vLLM on CPU: what only an in-process CPU engine runs.

- `weights`: the direct weight path (`DirectLoader`): GEMM handles built straight from the bridge's lent buckets.
- `moe_reload`: the two repairs vLLM 0.32 needs to serve a mixture-of-experts model in process on CPU.

The megatron-core side of running on CPU lives in runtime/cpu/, below every wing; this one needs the rollout
wing's weight manifest and so sits inside it (docs/design.md, "Layers").
"""
