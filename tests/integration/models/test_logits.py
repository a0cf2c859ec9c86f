"""Megatron logits equal HF transformers' logits (fp32, <= 1e-4) at every (TP, PP) layout, for a Qwen2 with qkv
bias, GQA and a vocab no TP size divides, and a Llama with tied embeddings and llama3 rope scaling."""

from __future__ import annotations

import pytest
import torch

from tests.integration.models.mp_helpers import build_chunks, hf_logits, max_valid_diff, pipeline_logits, varied_batch

pytestmark = pytest.mark.dist

LENGTHS = [5, 16, 11]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(make_tiny_hf_model(arch, root / arch, seed=7)) for arch in ("qwen2", "llama")}


def _logits_worker(hf_dir: str, tp: int, pp: int, input_ids: torch.Tensor):
    from megatron_rlvr.runtime import distributed

    try:
        _, chunks = build_chunks(hf_dir, tp, pp)
        return pipeline_logits(chunks, input_ids)
    finally:
        distributed.destroy_model_parallel()


def _check(group, hf_dir: str, tp: int, pp: int) -> float:
    from megatron_rlvr.models import load_hf_config

    vocab = load_hf_config(hf_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS)
    reference = hf_logits(hf_dir, ids, LENGTHS)
    results = group.run(_logits_worker, hf_dir, tp, pp, ids)
    outs = [r for r in results if r is not None]
    assert outs, "no rank returned logits"
    diffs = [max_valid_diff(o, reference, LENGTHS, vocab) for o in outs]
    print(f"{hf_dir.rsplit('/', 1)[-1]} TP={tp} PP={pp}: max |megatron - HF| = {max(diffs):.2e}")
    return max(diffs)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_logits_match_hf_two_ranks(workers2, tiny_models, arch, tp, pp):
    assert _check(workers2, tiny_models[arch], tp, pp) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_hf_tp2_pp2(workers4, tiny_models, arch):
    assert _check(workers4, tiny_models[arch], 2, 2) <= TOL
