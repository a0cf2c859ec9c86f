"""Dist checkpoints reload under any layout: one written at TP=2 loads at TP=1 and at PP=2 with the same logits as
HF (within fp32 rounding of two implementations, megatron_rlvr/testing/rounding.py); the converter's checkpoint loads at TP=2 and PP=2; and a TP=2 checkpoint converts back to the HF tensors
bit-exactly (vocab padding never reaches the checkpoint)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.models.mp_helpers import build_chunks, hf_logits, max_valid_diff, pipeline_logits, varied_batch

pytestmark = pytest.mark.dist

LENGTHS = [7, 13, 4]


def _bound(hf_dir: str, reference: torch.Tensor, vocab: int) -> float:
    """fp32 rounding of megatron-core vs transformers on these logits (megatron_rlvr/testing/rounding.py)."""
    from megatron_rlvr.models import load_hf_config
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.testing.rounding import fp32_logit_bound

    scale = max(reference[i, :n, :vocab].abs().max().item() for i, n in enumerate(LENGTHS))
    return fp32_logit_bound(ModelDims.from_hf(load_hf_config(hf_dir)), max(LENGTHS), scale)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("dist_ckpt")
    return {arch: str(make_tiny_hf_model(arch, root / arch, seed=21)) for arch in ("qwen2", "llama")}


def _save_worker(hf_dir: str, ckpt_dir: str, tp: int, pp: int, megatron_default: bool = False):
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rlvr.bridge.dist_ckpt import save_dist_checkpoint
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp)
        if dist.get_rank() == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        if megatron_default:  # as an actor checkpoint saves it: vocab rows padded for this TP
            dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, ckpt_dir)
        else:
            save_dist_checkpoint(chunks, hf["vocab_size"], ckpt_dir)
    finally:
        distributed.destroy_model_parallel()


def _load_worker(hf_dir: str, ckpt_dir: str, tp: int, pp: int, ids: torch.Tensor):
    from megatron_rlvr.bridge.dist_ckpt import load_dist_checkpoint
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, seed=99, load=False)  # random weights until the load
        load_dist_checkpoint(chunks, hf["vocab_size"], ckpt_dir)
        return pipeline_logits(chunks, ids)
    finally:
        distributed.destroy_model_parallel()


def _max_diff(results, reference, vocab) -> float:
    outs = [r for r in results if r is not None]
    assert outs
    return max(max_valid_diff(o, reference, LENGTHS, vocab) for o in outs)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tp2_checkpoint_loads_at_tp1_and_pp2(workers2, models, tmp_path, arch):
    from megatron_rlvr.models import load_hf_config

    hf_dir, ckpt = models[arch], str(tmp_path / "ckpt")
    vocab = load_hf_config(hf_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS, seed=5)
    reference = hf_logits(hf_dir, ids, LENGTHS)
    workers2.run(_save_worker, hf_dir, ckpt, 2, 1)
    for tp, pp in [(1, 1), (1, 2)]:
        diff = _max_diff(workers2.run(_load_worker, hf_dir, ckpt, tp, pp, ids), reference, vocab)
        bound = _bound(hf_dir, reference, vocab)
        print(f"{arch}: saved at TP=2, loaded at TP={tp} PP={pp}: max |logits - HF| = {diff:.2e}, bound {bound:.2e}")
        assert diff <= bound


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_converted_checkpoint_loads_at_tp2_and_pp2(workers2, models, tmp_path, arch):
    from megatron_rlvr.bridge.convert import main as convert
    from megatron_rlvr.models import load_hf_config

    hf_dir, ckpt = models[arch], str(tmp_path / "mcore")
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", ckpt]) == 0
    vocab = load_hf_config(hf_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS, seed=6)
    reference = hf_logits(hf_dir, ids, LENGTHS)
    for tp, pp in [(2, 1), (1, 2)]:
        diff = _max_diff(workers2.run(_load_worker, hf_dir, ckpt, tp, pp, ids), reference, vocab)
        bound = _bound(hf_dir, reference, vocab)
        print(f"{arch}: converted checkpoint at TP={tp} PP={pp}: max |logits - HF| = {diff:.2e}, bound {bound:.2e}")
        assert diff <= bound


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tp2_checkpoint_converts_back_bit_exact(workers2, models, tmp_path, arch):
    from megatron_rlvr.bridge import HFCheckpointReader
    from megatron_rlvr.bridge.convert import main as convert

    hf_dir, ckpt = models[arch], str(tmp_path / "ckpt")
    workers2.run(_save_worker, hf_dir, ckpt, 2, 1)
    out = tmp_path / "hf"
    assert convert(["mcore-to-hf", "--mcore-dir", ckpt, "--hf-config", hf_dir, "--out", str(out)]) == 0
    with HFCheckpointReader(hf_dir) as a, HFCheckpointReader(out) as b:
        assert sorted(a.names()) == sorted(b.names())
        for name in a.names():
            assert torch.equal(a.read(name), b.read(name)), name


def test_megatron_default_padded_checkpoint_loads_and_converts(workers2, models, tmp_path):
    """An actor checkpoint (megatron's own state dict: 1001 vocab rows padded to 1024 at TP=2) loads at TP=1 and
    PP=2 and converts to the HF tensors bit-exactly."""
    from megatron_rlvr.bridge import HFCheckpointReader
    from megatron_rlvr.bridge.convert import main as convert
    from megatron_rlvr.bridge.dist_ckpt import DistCheckpointReader
    from megatron_rlvr.models import load_hf_config

    hf_dir, ckpt = models["qwen2"], str(tmp_path / "ckpt")
    workers2.run(_save_worker, hf_dir, ckpt, 2, 1, True)
    assert DistCheckpointReader(ckpt).shape("embedding.word_embeddings.weight") == (1024, 128)
    vocab = load_hf_config(hf_dir)["vocab_size"]
    ids = varied_batch(vocab, LENGTHS, seed=8)
    reference = hf_logits(hf_dir, ids, LENGTHS)
    for tp, pp in [(1, 1), (1, 2)]:
        diff = _max_diff(workers2.run(_load_worker, hf_dir, ckpt, tp, pp, ids), reference, vocab)
        assert diff <= _bound(hf_dir, reference, vocab), (tp, pp, diff)
    out = tmp_path / "hf"
    assert convert(["mcore-to-hf", "--mcore-dir", ckpt, "--hf-config", hf_dir, "--out", str(out)]) == 0
    with HFCheckpointReader(hf_dir) as a, HFCheckpointReader(out) as b:
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(a.read(n), b.read(n)) for n in a.names())
