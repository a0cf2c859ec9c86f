"""`megatron-rlvr eval` argument handling: clear errors, model tags, the lazily imported vLLM engine."""

import json
import sys

import pytest

from megatron_rlvr.eval.api import model_tags, vllm_engine_factory
from megatron_rlvr.eval.command import build_parser, config_from_args, main
from megatron_rlvr.eval.config import EvalConfig


def test_missing_model_dir_unknown_benchmark_and_missing_data_are_reported(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--benchmarks", "gsm8k", "--data-dir", str(tmp_path)]) == 2
    assert "not an HF model directory" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert main(["--model", str(model), "--benchmarks", "gsm8k,poetry", "--data-dir", str(tmp_path)]) == 2
    assert "unknown ['poetry']" in capsys.readouterr().err
    assert (
        main(
            ["--model", str(model), "--benchmarks", "gsm8k", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "gsm8k.jsonl" in err and "Expected layout: GSM8K" in err


def test_config_from_args():
    args = build_parser().parse_args(
        ["--model", "a", "--benchmarks", "math500,aime24", "gsm8k", "--n", "1024", "--chunk", "2048"]
    )
    cfg, reward_cfg = config_from_args(args)
    assert cfg.benchmarks == ["math500", "aime24", "gsm8k"] and cfg.n_samples == 1024 and cfg.chunk == 1024
    assert reward_cfg.workers >= 1


def test_model_tags_are_short_and_distinct(tmp_path):
    assert model_tags([str(tmp_path / "x" / "ckpt"), str(tmp_path / "y" / "ckpt")]) == ["x-ckpt", "y-ckpt"]
    assert model_tags([str(tmp_path / "base"), str(tmp_path / "casp")]) == ["base", "casp"]
    with pytest.raises(ValueError, match="same model is given twice"):
        model_tags([str(tmp_path / "a"), str(tmp_path / "a")])


def test_labels_name_the_models_one_each_distinct(tmp_path):
    models = [str(tmp_path / "demo" / "model"), str(tmp_path / "train" / "hf")]
    assert model_tags(models) == ["model", "hf"]
    assert model_tags(models, ["base", "casp step 100"]) == ["base", "casp_step_100"]
    with pytest.raises(ValueError, match=r"--label: one per --model \(2 models, 1 labels\)"):
        model_tags(models, ["base"])
    with pytest.raises(ValueError, match="--label: names must be distinct"):
        model_tags(models, ["same", "same"])


def test_a_bad_label_is_one_line_before_any_engine(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    args = ["--model", str(model), "--label", "a", "b", "--benchmarks", "gsm8k", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert capsys.readouterr().err == "error: --label: one per --model (1 models, 2 labels)\n"


def test_missing_vllm_engine_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron_rlvr.rollout.vllm_engine", None)  # import now raises ImportError
    with pytest.raises(RuntimeError, match="samples through megatron_rlvr.rollout.vllm_engine, which failed to import"):
        vllm_engine_factory(2048)("some/model", EvalConfig())
