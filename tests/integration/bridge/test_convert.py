"""tools/convert.py: HF -> Megatron -> HF is bit-exact (single and sharded safetensors, tied and untied); bad
input (missing shard, wrong shape, unsupported architecture, truncated file, existing output) fails with an error
naming the file/tensor and leaves the output directory untouched."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlvr.bridge import HFCheckpointReader
from megatron_rlvr.bridge.convert import main as convert
from megatron_rlvr.testing.tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[3]


def _state(hf_dir) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    return {
        "qwen2": make_tiny_hf_model("qwen2", root / "qwen2", seed=11),
        "llama": make_tiny_hf_model("llama", root / "llama", seed=12, max_shard_size="300KB"),
    }


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_to_mcore_to_hf_is_bit_exact(models, tmp_path, arch):
    src = models[arch]
    assert convert(["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "mcore")]) == 0
    assert (tmp_path / "mcore" / "metadata.json").is_file() and (tmp_path / "mcore" / "hf" / "config.json").is_file()
    assert (
        convert(
            [
                "mcore-to-hf",
                "--mcore-dir",
                str(tmp_path / "mcore"),
                "--out",
                str(tmp_path / "hf"),
                "--max-shard-size",
                "200KB",
            ]
        )
        == 0
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # several shards were written
    before, after = _state(src), _state(tmp_path / "hf")
    assert sorted(before) == sorted(after)  # tied: no lm_head in either
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_converted_checkpoint_loads_in_transformers(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    convert(["hf-to-mcore", "--hf-dir", str(models["qwen2"]), "--out", str(tmp_path / "mcore")])
    convert(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")])
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(models["qwen2"]).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    assert torch.equal(a, b)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == 256


def test_script_entry_point(models, tmp_path):
    out = tmp_path / "mcore"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert.py"),
            "hf-to-mcore",
            "--hf-dir",
            str(models["qwen2"]),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hf-to-mcore" in proc.stderr and (out / "metadata.json").is_file()
    assert "Transformer Engine" not in proc.stderr and "Apex" not in proc.stderr, "quiet, as `megatron-rlvr convert`"


def test_the_progress_bar_ends_at_its_total(models, tmp_path, capsys):
    assert convert(["hf-to-mcore", "--hf-dir", str(models["qwen2"]), "--out", str(tmp_path / "mcore")]) == 0
    capsys.readouterr()
    assert convert(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")]) == 0
    done, total = re.findall(r"mcore-to-hf: .*?(\d+)/(\d+)", capsys.readouterr().err)[-1]
    assert done == total, f"the bar stopped at {done}/{total}"


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fails(args: list[str], capsys, *needles: str) -> str:
    assert convert(args) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in: {err}"
    return err


def test_missing_shard_is_named(models, tmp_path, capsys):
    src = _copy(models["llama"], tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (src / victim).unlink()
    _fails(["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "out")], capsys, victim, "missing")
    assert not (tmp_path / "out").exists()


def test_wrong_shape_is_named(models, tmp_path, capsys):
    from safetensors.torch import save_file

    src = _copy(models["qwen2"], tmp_path / "src")
    state = _state(src)
    state["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    _fails(
        ["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "out")],
        capsys,
        "model.layers.2.self_attn.k_proj.weight",
        "[32, 128]",
        "[64, 128]",
    )
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_named(models, tmp_path, capsys):
    src = _copy(models["qwen2"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    _fails(
        ["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "out")],
        capsys,
        "MistralForCausalLM",
        "config.json",
    )
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors_is_named(models, tmp_path, capsys):
    src = _copy(models["qwen2"], tmp_path / "src")
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _fails(["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "out")], capsys, str(path))
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused_or_kept_on_failure(models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    _fails(["hf-to-mcore", "--hf-dir", str(models["qwen2"]), "--out", str(out)], capsys, "--overwrite")
    # --overwrite with bad input: the failure leaves the old output exactly as it was
    src = _copy(models["qwen2"], tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert convert(["hf-to-mcore", "--hf-dir", str(src), "--out", str(out), "--overwrite"]) == 2
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"], "temporary directory left behind"
    # and a good --overwrite replaces it
    assert convert(["hf-to-mcore", "--hf-dir", str(models["qwen2"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "metadata.json").is_file() and not (out / "keep.txt").exists()


def test_mcore_shape_mismatch_is_named(models, tmp_path, capsys):
    convert(["hf-to-mcore", "--hf-dir", str(models["qwen2"]), "--out", str(tmp_path / "mcore")])
    config = json.loads((tmp_path / "mcore" / "hf" / "config.json").read_text())
    config["intermediate_size"] = 512
    (tmp_path / "mcore" / "hf" / "config.json").write_text(json.dumps(config))
    _fails(
        ["mcore-to-hf", "--mcore-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")],
        capsys,
        "decoder.layers.mlp.linear_fc1.weight",
    )
    assert not (tmp_path / "hf").exists()
