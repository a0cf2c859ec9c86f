"""Qwen3 dense through the bridge: HF -> megatron (load at (TP, PP) = (1,1), (2,1), (1,2)) -> HF (gathered
export) is bit-exact, q/k norms included; tools/convert.py HF -> mcore -> HF is bit-exact."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.bridge import HFCheckpointReader
from tests.integration.models.mp_helpers import build_chunks


def _hf_state(hf_dir) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_bridge") / "qwen3", seed=22))


def _round_trip_worker(hf_dir: str, tp: int, pp: int):
    from megatron_rlvr.bridge import export_hf_weights
    from megatron_rlvr.runtime import distributed

    try:
        hf, chunks = build_chunks(hf_dir, tp, pp)
        return {n: t.clone() for bucket in export_hf_weights(chunks, hf, bucket_bytes=100_000) for n, t in bucket}
    finally:
        distributed.destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_qwen3_hf_megatron_hf_is_bit_exact(workers2, qwen3_dir, tp, pp):
    expected = _hf_state(qwen3_dir)
    assert any(n.endswith("q_norm.weight") for n in expected) and not any(n.endswith(".bias") for n in expected)
    for got in workers2.run(_round_trip_worker, qwen3_dir, tp, pp):
        assert sorted(got) == sorted(expected)
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_qwen3_convert_round_trip_is_bit_exact(qwen3_dir, tmp_path):
    from megatron_rlvr.bridge.convert import main as convert

    assert convert(["hf-to-mcore", "--hf-dir", qwen3_dir, "--out", str(tmp_path / "mcore")]) == 0
    assert convert(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")]) == 0
    before, after = _hf_state(qwen3_dir), _hf_state(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
