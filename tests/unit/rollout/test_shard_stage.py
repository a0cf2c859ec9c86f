"""`ShardStage` ("full" staging that keeps one engine-TP shard): the staged slices are vLLM's partitioning of the
checked stream, the full-shape tensors handed to a self-slicing loader give back exactly those slices, a bad stream
(wrong shape in the last bucket, a tied pair that differs) keeps nothing and raises after draining, and the staged
bytes are about the model / engine TP."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.bridge.reshard import engine_shard
from megatron_rlvr.models import load_hf_config
from megatron_rlvr.models.dims import ModelDims
from megatron_rlvr.rollout.shard_stage import ShardStage
from megatron_rlvr.rollout.weight_manifest import WeightManifest, WeightSyncError
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model


def _model(tmp_path, family: str, **kw):
    from megatron_rlvr.bridge import HFCheckpointReader

    hf_dir = make_tiny_hf_model(family, tmp_path / family, seed=3, **kw)
    with HFCheckpointReader(hf_dir) as reader:
        weights = {n: reader.read(n) for n in reader.names()}
    manifest = WeightManifest.from_model_dir(hf_dir)
    if manifest.tied_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights, manifest, ModelDims.from_hf(load_hf_config(hf_dir))


def _nbytes(weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


@pytest.mark.parametrize("family, tp", [("qwen2", 1), ("qwen2", 2), ("llama", 2)])
def test_staged_shards_are_vllms_slices_and_full_tensors_give_them_back(tmp_path, family, tp):
    kw = {"num_key_value_heads": 2, "vocab_size": 1024} if family == "qwen2" else {"vocab_size": 1024}
    weights, manifest, dims = _model(tmp_path, family, **kw)
    model_bytes = _nbytes(weights)
    per_rank = []
    for rank in range(tp):
        staged = ShardStage(manifest, dims, tp, rank).stage(iter(weights.items()))
        per_rank.append(staged.peak_bytes)
        shards = dict(staged.shards())
        assert list(shards) == list(weights)
        for name, shard in shards.items():
            want = engine_shard(name, weights[name], dims, tp, rank)
            assert shard.dtype == want.dtype and torch.equal(shard, want), name
            assert shard.untyped_storage().data_ptr() != weights[name].untyped_storage().data_ptr()  # a copy
        for name, full in staged.full_tensors():  # a loader that slices for its own TP rank, as vLLM's do
            assert tuple(full.shape) == tuple(weights[name].shape)
            assert torch.equal(
                engine_shard(name, full, dims, tp, rank), engine_shard(name, weights[name], dims, tp, rank)
            ), name
        assert staged.items == [] and staged.nbytes == 0  # handed over: the stage let go of every shard
    norms = sum(_nbytes({n: t}) for n, t in weights.items() if "norm" in n)
    for peak in per_rank:
        assert peak <= model_bytes / tp + norms
    assert sum(per_rank) >= model_bytes  # together the ranks hold the model


def test_a_wrong_shape_in_the_last_bucket_keeps_nothing_and_drains_the_stream(tmp_path):
    weights, manifest, dims = _model(tmp_path, "qwen2", num_key_value_heads=2, vocab_size=1024)
    items = list(weights.items())
    last_name, last = items[-1]
    items[-1] = (last_name, last[:-1])
    drawn = []

    def stream():
        for item in items:
            drawn.append(item[0])
            yield item

    stage = ShardStage(manifest, dims, 2, 1)
    with pytest.raises(WeightSyncError, match=f"{last_name}.*shape"):
        stage.stage(stream())
    assert len(drawn) == len(items)  # drained: a collective producer ran to its end


def test_a_tied_pair_that_differs_is_refused_and_an_equal_one_passes(tmp_path):
    weights, manifest, dims = _model(tmp_path, "llama", vocab_size=1024)
    assert manifest.tied_embeddings
    stage = ShardStage(manifest, dims, 2, 0)
    good = stage.stage(iter(weights.items()))
    assert "lm_head.weight" in dict(good.shards())
    bad = dict(weights)
    bad["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    bad["lm_head.weight"][-1, -1] += 1.0  # a row rank 0 does not even keep: every rank still refuses
    with pytest.raises(WeightSyncError, match="lm_head.weight.*differs"):
        stage.stage(iter(bad.items()))


def test_lent_views_overwritten_after_each_item_are_staged_correctly(tmp_path):
    """The transfer's receive buffer is reused message to message: the stage must copy on arrival."""
    weights, manifest, dims = _model(tmp_path, "qwen2", num_key_value_heads=2, vocab_size=1024)
    scratch = torch.empty(max(t.numel() for t in weights.values()))

    def lent():
        for name, t in weights.items():
            view = scratch[: t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view
            view.fill_(float("nan"))

    staged = ShardStage(manifest, dims, 2, 0).stage(lent())
    for name, shard in staged.shards():
        assert torch.equal(shard, engine_shard(name, weights[name], dims, 2, 0)), name


def test_bad_rank_is_refused(tmp_path):
    _, manifest, dims = _model(tmp_path, "qwen2", num_key_value_heads=2, vocab_size=1024)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ShardStage(manifest, dims, 2, 2)
