"""load_hf_weights refuses a checkpoint with a missing or mis-shaped tensor, naming it, before touching any
parameter; a model built for another config is refused naming the parameter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.integration.models.mp_helpers import build_chunks

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf_load") / "qwen2", seed=2)


def _load_worker(build_dir: str, load_dir: str):
    from megatron_rlvr.bridge import BridgeError, HFCheckpointError, load_hf_weights
    from megatron_rlvr.runtime import distributed

    try:
        _, chunks = build_chunks(build_dir, 2, 1, load=False)
        before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
        try:
            load_hf_weights(chunks, load_dir)
            message = None
        except (BridgeError, HFCheckpointError) as e:
            message = str(e)
        untouched = all(torch.equal(p, before[n]) for n, p in chunks[0].named_parameters())
        return message, untouched
    finally:
        distributed.destroy_model_parallel()


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mis_shaped_tensor_is_named_and_nothing_loaded(workers2, qwen2, tmp_path):
    bad = _rewrite(
        qwen2, tmp_path / "bad", lambda s: s.update({"model.layers.3.mlp.up_proj.weight": torch.zeros(5, 128)})
    )
    for message, untouched in workers2.run(_load_worker, str(qwen2), str(bad)):
        assert "model.layers.3.mlp.up_proj.weight" in message and "[5, 128]" in message
        assert untouched


def test_missing_tensor_is_named_and_nothing_loaded(workers2, qwen2, tmp_path):
    bad = _rewrite(qwen2, tmp_path / "bad", lambda s: s.pop("model.layers.1.self_attn.v_proj.bias"))
    for message, untouched in workers2.run(_load_worker, str(qwen2), str(bad)):
        assert "model.layers.1.self_attn.v_proj.bias" in message and "not found" in message
        assert untouched


def test_model_for_another_config_is_refused(workers2, qwen2, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(qwen2, other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 384
    (other / "config.json").write_text(json.dumps(config))
    for message, untouched in workers2.run(_load_worker, str(qwen2), str(other)):
        assert "mlp.linear_fc1.weight" in message and untouched
