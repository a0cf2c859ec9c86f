"""Streaming export: at (TP,PP) = (2,1), (1,2), (2,2) the gathered export equals the HF checkpoint exactly, on
every rank, in buckets never over the bound (unless one tensor is larger), through shared memory and through gloo;
a rank passing receive=False gets nothing while the others still get everything; a TP shard of vocabulary padding
only is skipped; lent buckets (views of shared memory) are exact too, hold whole parameters, and fall back to fresh
tensors where lending is impossible; the HF tensors of one parameter
lie back to back ([q; k; v], [gate; up]); lm_head is always sent; the plan is built once; the no-gather shard path
reassembles to the same tensors; a missing or mis-shaped tensor is refused on every rank before anything is
yielded, naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.models.mp_helpers import build_chunks

pytestmark = pytest.mark.dist

BUCKET_BYTES = 100_000  # smaller than the embedding (~512 KB): exercises both rules of the bound


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_export")
    return {
        "qwen2": str(make_tiny_hf_model("qwen2", root / "qwen2", seed=3)),
        # sharded input checkpoint: the loader must follow the index
        "llama": str(make_tiny_hf_model("llama", root / "llama", seed=4, max_shard_size="300KB")),
        # 40 tokens in a table padded to 128: TP rank 1's vocabulary shard is padding only (the demo model's case)
        "small_vocab": str(make_tiny_hf_model("qwen2", root / "small_vocab", seed=6, vocab_size=40)),
    }


def _hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    from megatron_rlvr.bridge import HFCheckpointReader

    with HFCheckpointReader(hf_dir) as reader:
        return {n: reader.read(n) for n in reader.names()}


def _export_worker(
    hf_dir: str,
    tp: int,
    pp: int,
    bucket_bytes: int,
    vpp: int | None = None,
    shm: bool = True,
    receive_ranks: tuple[int, ...] | None = None,
    lend_ranks: tuple[int, ...] = (),
    whole: bool = True,
):
    from megatron_rlvr.bridge import export, export_hf_weights
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, vpp=vpp)
        rank = torch.distributed.get_rank()
        receive, lend = receive_ranks is None or rank in receive_ranks, rank in lend_ranks
        builds = export.PLAN_BUILDS
        lent, adjacent, packed = [], True, 0
        touched: list[int] = []  # per lent bucket: the furthest byte of its slot it reaches

        def run():
            # A lent bucket is valid until the next one is asked for: checked (adjacency) and copied before that.
            nonlocal adjacent, packed
            out = []
            options = dict(receive=receive, lend=lend, shm_exchange=shm, lend_whole_calls=whole)
            for b in export_hf_weights(chunks, hf, bucket_bytes=bucket_bytes, **options):
                lent.append(all(_in_lend_slots(chunks, t) for _, t in b))
                if lent[-1]:
                    ex = chunks[0]._megatron_rlvr_export_plan.lend_exchange
                    base = ex.segments[0].data_ptr()
                    ends = [(t.data_ptr() - base) % ex.slot_bytes + t.numel() * t.element_size() for _, t in b]
                    touched.append(max(ends))
                if lent[-1]:  # a lent bucket holds whole parameters
                    adjacent = adjacent and _packed_parts_adjacent([b], require=False)
                    packed += _packed_parts_adjacent([b])
                out.append([(n, t.clone() if lent[-1] else t) for n, t in b])
            return out

        first = run()
        second = run()
        plan = chunks[0]._megatron_rlvr_export_plan
        return {
            "buckets": first,
            "again_equal": _same(first, second),
            "plan_builds": export.PLAN_BUILDS - builds,
            "shm_used": plan.exchange is not None,
            # lent buckets: checked on each as it came, before copying; fresh ones: on the whole export
            "adjacent": adjacent and packed > 0 if any(lent) else _packed_parts_adjacent(first),
            "lent": bool(lent) and all(lent),
            "some_lent": any(lent),
            "lend_whole": plan.lend_whole,
            "slot_bytes_touched": max(touched, default=0),
        }
    finally:
        distributed.destroy_model_parallel()


def _in_lend_slots(chunks, t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of the export's shared lending slots."""
    exchange = chunks[0]._megatron_rlvr_export_plan.lend_exchange
    if exchange is None:
        return False
    base = exchange.segments[0].data_ptr()
    return base <= t.data_ptr() < base + 2 * exchange.slot_bytes


def _packed_parts_adjacent(buckets, require: bool = True) -> bool:
    """Whether every layer's q/k/v and gate/up weights lie back to back in one buffer (what lets an engine with
    packed layers take them without a copy); ``require``: and there is at least one such layer."""
    got = {n: t for bucket in buckets for n, t in bucket}
    groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    checked = 0
    for name in got:
        for group in groups:
            if name.endswith(f"{group[0]}.weight"):
                parts = [got[name.replace(group[0], g)] for g in group]
                base = parts[0].untyped_storage().data_ptr()
                offsets = [p.storage_offset() for p in parts]
                ends = [o + p.numel() for o, p in zip(offsets, parts)]
                if any(p.untyped_storage().data_ptr() != base for p in parts) or offsets[1:] != ends[:-1]:
                    return False
                checked += 1
    return checked > 0 or not require


def _same(a, b) -> bool:
    return [[n for n, _ in x] for x in a] == [[n for n, _ in x] for x in b] and all(
        torch.equal(t, u) for x, y in zip(a, b) for (_, t), (_, u) in zip(x, y)
    )


def _parameter_of(name: str) -> str:
    """The Megatron parameter an HF name comes from (q/k/v, gate/up and a tied lm_head share one)."""
    for part, whole in (
        ("q_proj", "qkv"),
        ("k_proj", "qkv"),
        ("v_proj", "qkv"),
        ("gate_proj", "fc1"),
        ("up_proj", "fc1"),
        ("lm_head", "model.embed_tokens"),
    ):
        name = name.replace(part, whole)
    return name


def _check_export(results, hf_dir: str, bucket_bytes: int) -> None:
    reference = _hf_state_dict(hf_dir)
    tied = "lm_head.weight" not in reference
    expected = dict(reference)
    if tied:
        expected["lm_head.weight"] = reference["model.embed_tokens.weight"]
    lending = any(r["some_lent"] for r in results)
    for rank, r in enumerate(results):
        assert r["plan_builds"] == 1, f"rank {rank}: export plan built {r['plan_builds']} times for two exports"
        assert r["again_equal"], f"rank {rank}: a second export differs from the first"
        got = {}
        for bucket in r["buckets"]:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            # where any rank lends, buckets hold whole parameters: over the bound only with one parameter's tensors
            one = len(bucket) == 1 or (lending and len({_parameter_of(n) for n, _ in bucket}) == 1)
            assert size <= bucket_bytes or one, f"rank {rank}: bucket of {size} B > {bucket_bytes} B"
            for name, t in bucket:
                assert name not in got, f"rank {rank}: {name} sent twice"
                got[name] = t
        assert sorted(got) == sorted(expected), f"rank {rank}: names differ: {set(got) ^ set(expected)}"
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"rank {rank}: {name} differs"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_gathered_export_is_exact(workers2, tiny_models, arch, tp, pp, shm):
    results = workers2.run(_export_worker, tiny_models[arch], tp, pp, BUCKET_BYTES, None, shm)
    _check_export(results, tiny_models[arch], BUCKET_BYTES)
    for r in results:
        assert r["shm_used"] == (shm and tp > 1), "the shared-memory exchange was (not) used"
        assert r["adjacent"], "q/k/v or gate/up of a layer are not back to back in one buffer"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_gathered_export_skips_a_vocabulary_shard_of_padding_only(workers2, tiny_models, shm):
    results = workers2.run(_export_worker, tiny_models["small_vocab"], 2, 1, BUCKET_BYTES, None, shm)
    _check_export(results, tiny_models["small_vocab"], BUCKET_BYTES)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_a_rank_that_does_not_receive_gets_nothing_and_the_others_everything(workers2, tiny_models, shm):
    results = workers2.run(_export_worker, tiny_models["qwen2"], 2, 1, BUCKET_BYTES, None, shm, (0,))
    _check_export(results[:1], tiny_models["qwen2"], BUCKET_BYTES)
    assert results[1]["buckets"] == [] and results[1]["plan_builds"] == 1


@pytest.mark.parametrize("model", ["qwen2", "llama", "small_vocab"])
@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 1 << 30])
@pytest.mark.parametrize("whole", [True, False], ids=["whole-call-slots", "round-slots"])
def test_lent_export_is_exact_and_lends_shared_memory(workers2, tiny_models, model, bucket_bytes, whole):
    """Host parameters lend whole-call slots (a consumer may keep them, bridge/lent_slots.py); device parameters one
    round per slot, so /dev/shm holds two rounds, not two models (``whole=False`` runs that layout on CPU)."""
    results = workers2.run(_export_worker, tiny_models[model], 2, 1, bucket_bytes, None, True, None, (0, 1), whole)
    _check_export(results, tiny_models[model], bucket_bytes)
    tied = json.loads((Path(tiny_models[model]) / "config.json").read_text()).get("tie_word_embeddings", False)
    sent = {n: t for b in results[0]["buckets"] for n, t in b if not (tied and n == "lm_head.weight")}
    model_bytes = sum(t.numel() * t.element_size() for t in sent.values())  # a tied lm_head is the embedding's view
    for r in results:
        assert r["lent"], "lend=True at TP=2 on one host: every tensor should be a view of the shared slots"
        assert r["adjacent"], "q/k/v or gate/up of a layer are not back to back in the lent slot"
        assert r["lend_whole"] == whole
        if whole:  # the last bucket lies at the end of one whole call's layout
            assert r["slot_bytes_touched"] >= model_bytes
        elif bucket_bytes == BUCKET_BYTES:  # each round from the start of its slot: one bucket (or one parameter)
            largest = max(t.numel() * t.element_size() for t in sent.values())
            assert r["slot_bytes_touched"] <= max(bucket_bytes, 3 * largest), (r["slot_bytes_touched"], model_bytes)


def test_lending_to_one_rank_gives_the_other_fresh_tensors_or_nothing(workers2, tiny_models):
    hf_dir = tiny_models["qwen2"]
    mixed = workers2.run(_export_worker, hf_dir, 2, 1, BUCKET_BYTES, None, True, None, (0,))
    _check_export(mixed, hf_dir, BUCKET_BYTES)
    assert mixed[0]["lent"] and not mixed[1]["some_lent"]
    served = workers2.run(_export_worker, hf_dir, 2, 1, BUCKET_BYTES, None, True, (0,), (0,))
    _check_export(served[:1], hf_dir, BUCKET_BYTES)
    assert served[0]["lent"] and served[1]["buckets"] == []


@pytest.mark.parametrize("tp,pp,shm", [(1, 2, True), (2, 1, False)])
def test_lend_falls_back_to_fresh_tensors_where_it_cannot_lend(workers2, tiny_models, tp, pp, shm):
    results = workers2.run(_export_worker, tiny_models["qwen2"], tp, pp, BUCKET_BYTES, None, shm, None, (0, 1))
    _check_export(results, tiny_models["qwen2"], BUCKET_BYTES)
    assert not any(r["some_lent"] for r in results)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gathered_export_is_exact_with_virtual_pipeline(workers2, tiny_models, arch):
    # PP=2 x VPP=2 over 4 layers: each rank holds two non-adjacent one-layer chunks
    results = workers2.run(_export_worker, tiny_models[arch], 1, 2, BUCKET_BYTES, 2)
    _check_export(results, tiny_models[arch], BUCKET_BYTES)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gathered_export_is_exact_tp2_pp2(workers4, tiny_models, arch):
    results = workers4.run(_export_worker, tiny_models[arch], 2, 2, BUCKET_BYTES)
    _check_export(results, tiny_models[arch], BUCKET_BYTES)


def _local_shards_worker(hf_dir: str, tp: int, pp: int):
    from megatron.core import parallel_state as ps

    from megatron_rlvr.bridge import export_local_shards
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp)
        shards = [s for bucket in export_local_shards(chunks, hf, bucket_bytes=BUCKET_BYTES) for s in bucket]
        return ps.get_tensor_model_parallel_rank(), shards
    finally:
        distributed.destroy_model_parallel()


def _check_local_shards(results, hf_dir: str) -> None:
    """Every rank with TP rank r holds shard r of every HF tensor; shards 0 and 1 concatenate to the HF tensor."""
    reference = _hf_state_dict(hf_dir)
    if "lm_head.weight" not in reference:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    by_tp_rank = {}
    for tp_rank, shards in results:
        names = {s.name: s for s in shards}
        assert sorted(names) == sorted(reference), f"TP rank {tp_rank}: names differ"
        if tp_rank in by_tp_rank:  # another pipeline stage of the same TP rank: identical shards
            assert all(torch.equal(names[n].tensor, by_tp_rank[tp_rank][n].tensor) for n in names)
        by_tp_rank[tp_rank] = names
    assert sorted(by_tp_rank) == [0, 1]
    for name, full in reference.items():
        pieces = [(r, by_tp_rank[r][name]) for r in (0, 1)]
        for _, s in pieces:
            assert s.full_shape == tuple(full.shape), name
        if pieces[0][1].dim is None:
            assert all(torch.equal(s.tensor, full) for _, s in pieces), name
            continue
        dim = pieces[0][1].dim
        assert [(s.start, s.stop) for _, s in pieces] == [(0, pieces[0][1].stop), (pieces[0][1].stop, full.shape[dim])]
        assert torch.equal(torch.cat([s.tensor for _, s in pieces], dim=dim), full), f"{name}: shards differ"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_local_shards_reassemble_to_hf(workers2, tiny_models, arch):
    _check_local_shards(workers2.run(_local_shards_worker, tiny_models[arch], 2, 1), tiny_models[arch])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_local_shards_reassemble_to_hf_tp2_pp2(workers4, tiny_models, arch):
    _check_local_shards(workers4.run(_local_shards_worker, tiny_models[arch], 2, 2), tiny_models[arch])


def _broken_worker(hf_dir: str, how: str):
    from megatron_rlvr.bridge import BridgeError, export_hf_weights
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, 2, 1)
        if how == "warm":  # the plan is cached first: the per-call check must still catch the change
            for _ in export_hf_weights(chunks, hf, bucket_bytes=BUCKET_BYTES):
                pass
        layer = chunks[0].decoder.layers[1]
        if torch.distributed.get_rank() == 1:  # one rank only: the others must refuse too, not hang
            layer.mlp.linear_fc2.weight = torch.nn.Parameter(torch.zeros(3, 3))
        chunks[0].decoder.final_layernorm.weight = None  # missing on every rank
        yielded = 0
        try:
            for _ in export_hf_weights(chunks, hf, bucket_bytes=BUCKET_BYTES):
                yielded += 1
        except BridgeError as e:
            return yielded, str(e)
        return yielded, None
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.parametrize("how", ["cold", "warm"])
def test_broken_model_is_refused_before_any_bucket(workers2, tiny_models, how):
    for yielded, message in workers2.run(_broken_worker, tiny_models["qwen2"], how):
        assert yielded == 0 and message is not None
        assert "decoder.layers.1.mlp.linear_fc2.weight" in message
        assert "decoder.final_layernorm.weight" in message
