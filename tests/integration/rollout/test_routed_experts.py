"""Routing capture for ``actor.router_replay: rollout`` (rollout/routed_experts.py): vLLM's per-layer rows become
[prompt + response tokens, MoE layers, top_k] (dense layers dropped, the never-forwarded last token -1), a malformed
array is refused naming its shape; ``rollout.return_routed_experts`` on a CPU engine is refused naming the key, because
vLLM-CPU cannot build such an engine (the exact failing call is a test here, so its change is noticed); on a GPU the
engine's experts equal what transformers' router picks for the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rollout.routed_experts import RoutedExpertsError, routed_experts, routing_of


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("routed") / "moe", seed=3))


def test_vllm_rows_become_the_completions_layout(moe_dir):
    from megatron_rlvr.models import load_hf_config

    moe_layers, top_k = routing_of(ModelDims.from_hf(load_hf_config(moe_dir)))
    assert moe_layers == (0, 2, 3) and top_k == 2  # layer 1 is dense (mlp_only_layers)
    prompt, response = 5, 3
    rows = np.arange((prompt + response - 1) * 4 * top_k, dtype=np.uint8).reshape(prompt + response - 1, 4, top_k)
    got = routed_experts(rows, prompt, response, moe_layers, top_k)
    assert got.shape == (prompt + response, 3, top_k) and got.dtype == torch.int64
    assert torch.equal(got[:-1], torch.as_tensor(rows[:, [0, 2, 3]]).long())
    assert (got[-1] == -1).all()  # the last sampled token was never forwarded
    full = np.zeros((prompt + response, 4, top_k), dtype=np.uint8)
    assert (routed_experts(full, prompt, response, moe_layers, top_k) == 0).all()  # an engine that ran it too
    with pytest.raises(RoutedExpertsError, match=r"returned 6 rows for 5 prompt \+ 3 response tokens"):
        routed_experts(rows[:6], prompt, response, moe_layers, top_k)
    with pytest.raises(RoutedExpertsError, match=r"shape \[7, 4, 1\], expected \[tokens, >3 layers, top_k=2\]"):
        routed_experts(rows[:, :, :1], prompt, response, moe_layers, top_k)


def test_a_cpu_engine_refuses_return_routed_experts_naming_the_key(moe_dir):
    from megatron_rlvr.rollout import RolloutConfig
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine

    if torch.cuda.is_available():
        pytest.skip("a GPU engine takes rollout.return_routed_experts")
    cfg = RolloutConfig(max_model_len=128, kv_cache_memory_bytes=16 << 20, return_routed_experts=True)
    with pytest.raises(
        ValueError, match=r"^rollout\.return_routed_experts=true: vLLM-CPU cannot return routed experts"
    ):
        VLLMEngine(moe_dir, cfg, seed=0)


@pytest.mark.engine
def test_vllm_cpu_cannot_build_an_engine_that_returns_routed_experts(moe_dir):
    """The call and the error vLLM 0.32 gives on CPU (no Triton, so no model runner V2): why the key is refused."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only limitation")
    from vllm import LLM

    with pytest.raises(Exception, match="AuxOutput Connector requires Model Runner V2"):
        LLM(model=moe_dir, dtype="float32", enable_return_routed_experts=True, distributed_executor_backend="uni")


@pytest.mark.engine
def test_routed_experts_equal_what_the_hf_router_picks(moe_dir):
    """GPU only (vLLM-CPU cannot return routing): each sampled sequence's routed experts, as sets per token and MoE
    layer, equal transformers' top-k of its router logits over the same tokens (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("vLLM's routed-experts capture needs model runner V2 (Triton): GPU only")
    from megatron_rlvr.rollout import RolloutConfig, Sampling
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine
    from tests.support.rollout.hf_reference import hf_router_topk, load_hf

    cfg = RolloutConfig(max_model_len=128, return_routed_experts=True, gpu_memory_utilization=0.3, enforce_eager=True)
    engine = VLLMEngine(moe_dir, cfg, seed=0, dtype="float32")
    try:
        prompts = [[5, 17, 99, 200, 3], [256, 1, 2, 3]]
        out = engine.generate(prompts, 2, Sampling(max_tokens=6, seed=1))
    finally:
        engine.close()
    hf = load_hf(moe_dir)
    for prompt, completions in zip(prompts, out):
        for c in completions:
            seq = prompt + c.token_ids
            assert c.routed_experts.shape == (len(seq), 3, 2)
            want = hf_router_topk(hf, seq, 2)
            got = c.routed_experts[:-1].sort(dim=-1).values  # the last token's row is -1 (never forwarded)
            assert torch.equal(got, want[:-1]), (seq, (got != want[:-1]).sum().item())
