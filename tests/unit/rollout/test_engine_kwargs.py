"""The engine arguments for each device are spelled as vLLM 0.32's EngineArgs spells them (the GPU path cannot run
on the development machine, so its arguments are at least checked against vLLM's own dataclass)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_rlvr.rollout import RolloutConfig


@pytest.mark.parametrize("on_gpu", [False, True])
def test_engine_kwargs_are_vllm_engine_args(on_gpu):
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs

    from megatron_rlvr.rollout.vllm_options import engine_kwargs

    cfg = RolloutConfig(
        tp=4, gpu_memory_utilization=0.35, kv_cache_memory_bytes=123 << 20, max_model_len=1024, kv_block_size=64
    )
    kwargs = engine_kwargs(cfg, on_gpu, seed=7, dtype="bfloat16")
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}
    assert not unknown, f"not vLLM EngineArgs fields: {unknown}"
    assert kwargs["logprobs_mode"] in typing.get_args(LogprobsMode)
    assert kwargs["seed"] == 7 and kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 1024
    assert kwargs["block_size"] == 64 and "block_size" not in engine_kwargs(RolloutConfig(), on_gpu, 7, "bfloat16")
    if on_gpu:
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == 4 and kwargs["enable_sleep_mode"] is True
        assert kwargs["gpu_memory_utilization"] == 0.35 and "kv_cache_memory_bytes" not in kwargs
    else:
        assert kwargs["distributed_executor_backend"] == "uni" and kwargs["tensor_parallel_size"] == 1
        assert kwargs["kv_cache_memory_bytes"] == 123 << 20 and kwargs["enforce_eager"] is True
