"""Qwen3-MoE through the bridge, mixed dense/MoE layers, norm_topk_prob both ways: HF -> megatron -> HF is bit-exact
at (TP, PP, EP) = (1,1,1), (2,1,1) (ETP=2), (1,2,1), (1,1,2), (2,1,2) (ETP=1) on 2 gloo processes.

Each rank loads its shards (its experts only, under EP), re-lays out every local shard into HF slices
(``layout.shard_to_hf``, with the ETP group for experts), and the slices of all ranks reassemble into every HF tensor
of the checkpoint exactly, replicas agreeing. The streaming export (``export_hf_weights``) gives every rank the HF
checkpoint bit for bit at every layout, experts from their EP owners (``bridge/expert_export.py``) in buckets within
the bound."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.bridge import HFCheckpointReader
from tests.integration.models.mp_helpers import build_chunks

pytestmark = pytest.mark.dist
BUCKET_BYTES = 100_000


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("qwen3_moe_bridge")
    return {
        norm: str(make_tiny_hf_model("qwen3_moe", root / f"norm_{norm}", seed=41, norm_topk_prob=norm))
        for norm in (True, False)
    }


def _hf_state(hf_dir) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as r:
        return {n: r.read(n) for n in r.names()}


def _pieces_worker(hf_dir: str, tp: int, pp: int, ep: int, etp: int | None, export: bool):
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.bridge.layout import shard_to_hf
    from megatron_rlvr.bridge.local_params import local_entries, shard_rank_and_size, tp_rank_and_size
    from megatron_rlvr.models.dims import ModelDims
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, ep=ep, etp=etp)
        dims = ModelDims.from_hf(hf)
        entries, problems = local_entries(chunks, dims, tp_rank_and_size()[1])
        assert not problems, problems
        pieces = []
        for e in entries:
            if e.param is not None:
                rank, size = shard_rank_and_size(e.mapping)
                pieces += [
                    (n, t.detach().clone(), d, a, b)
                    for n, t, d, a, b in shard_to_hf(e.mapping, e.param.detach(), dims, rank, size)
                ]
        exported, largest = None, 0
        if export:
            exported = {}
            for b in export_hf_weights(chunks, hf, bucket_bytes=BUCKET_BYTES):
                size = sum(t.numel() * t.element_size() for _, t in b)
                largest = max(largest, size if len(b) > 1 else 0)  # one tensor may exceed the bound alone
                exported.update((n, t.clone()) for n, t in b)
            # once more: the cached plan (built once) serves the EP owners too
            again = {n: t.clone() for b in export_hf_weights(chunks, hf, bucket_bytes=BUCKET_BYTES) for n, t in b}
            assert sorted(again) == sorted(exported) and all(torch.equal(again[n], t) for n, t in exported.items())
        return pieces, (exported, largest)
    finally:
        distributed.destroy_model_parallel()


def _reassemble(results, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: torch.full_like(t, float("nan")) for n, t in expected.items()}
    for pieces, _ in results:
        for name, t, dim, start, stop in pieces:
            target = out[name] if dim is None else out[name].narrow(dim, start, stop - start)
            filled = ~torch.isnan(target)
            assert torch.equal(target[filled], t[filled]), f"{name}: replicas disagree"
            target.copy_(t)
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(
    "tp,pp,ep,etp", [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, 1), (2, 1, 2, 1), (2, 1, 1, 1)]
)
def test_moe_hf_megatron_hf_is_bit_exact(workers2, moe_dirs, norm, tp, pp, ep, etp):
    expected = _hf_state(moe_dirs[norm])
    assert any(".mlp.experts.7.down_proj" in n for n in expected) and "model.layers.1.mlp.gate_proj.weight" in expected
    results = workers2.run(_pieces_worker, moe_dirs[norm], tp, pp, ep, etp, True)
    got = _reassemble(results, expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name  # NaN left anywhere (a slice no rank holds) fails here too
    if ep > 1:  # each EP rank holds only its own experts
        for pieces, _ in results:
            held = {n.split(".mlp.experts.")[1].split(".")[0] for n, *_ in pieces if ".mlp.experts." in n}
            assert len(held) == 8 // ep, held
    for _, (exported, largest) in results:  # every rank receives the whole checkpoint, experts from their owners
        assert sorted(exported) == sorted(expected)
        assert all(torch.equal(exported[n], t) for n, t in expected.items())
        assert largest <= BUCKET_BYTES


def _dist_ckpt_worker(hf_dir: str, mcore_in: str, mcore_out: str, tp: int, pp: int, ep: int, etp: int | None):
    """Load the converter's dist checkpoint at (TP, PP, EP, ETP) into random weights, export (every rank: the HF
    checkpoint), and save it again at this layout."""
    import os

    import torch.distributed as dist

    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.bridge.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp, seed=99, load=False, ep=ep, etp=etp)  # random until the load
        load_dist_checkpoint(chunks, hf["vocab_size"], mcore_in)
        exported = {n: t.clone() for b in export_hf_weights(chunks, hf, bucket_bytes=BUCKET_BYTES) for n, t in b}
        if dist.get_rank() == 0:
            os.makedirs(mcore_out, exist_ok=True)
        dist.barrier()
        save_dist_checkpoint(chunks, hf["vocab_size"], mcore_out)
        return exported
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 2, 1), (2, 1, 2, 1), (2, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, None)])
def test_convert_round_trips_through_any_expert_layout_bit_exact(workers2, moe_dirs, tmp_path, tp, pp, ep, etp):
    """tools/convert.py HF -> mcore, loaded and saved again at (TP, PP, EP, ETP) on 2 processes, mcore -> HF: every
    tensor bit for bit (the dist checkpoint keys experts on a global expert axis, whatever EP wrote it)."""
    from megatron_rlvr.bridge.convert import main as convert

    hf_dir = moe_dirs[False]
    expected = _hf_state(hf_dir)
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "mcore")]) == 0
    out = str(tmp_path / "mcore_again")
    exported = workers2.run(_dist_ckpt_worker, hf_dir, str(tmp_path / "mcore"), out, tp, pp, ep, etp)
    for got in exported:
        assert sorted(got) == sorted(expected) and all(torch.equal(got[n], t) for n, t in expected.items())
    assert convert(["mcore-to-hf", "--mcore-dir", out, "--hf-config", hf_dir, "--out", str(tmp_path / "hf")]) == 0
    back = _hf_state(tmp_path / "hf")
    assert sorted(back) == sorted(expected)
    assert [n for n, t in expected.items() if not torch.equal(back[n], t)] == []
