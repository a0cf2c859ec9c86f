"""`megatron-rlvr eval` argument handling: clear errors, model tags, the lazily imported vLLM engine, the chat flags
(system prompt, answer format) and the run settings they enter."""

import json
import sys

import pytest

from megatron_rlvr.eval.api import model_tags, vllm_engine_factory
from megatron_rlvr.eval.command import build_parser, config_from_args, main
from megatron_rlvr.eval.config import EvalConfig
from megatron_rlvr.eval.runner import EvalConfigError


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
    assert cfg.system_prompt is None and not cfg.chat_template and reward_cfg.answer == "tagged"
    assert not reward_cfg.sandbox_accept_rlimits_only  # an eval with no namespaces stops, as a training run does
    accepting = ["--model", "a", "--benchmarks", "livecodebench", "--sandbox-accept-rlimits-only"]
    assert config_from_args(build_parser().parse_args(accepting))[1].sandbox_accept_rlimits_only
    chat = ["--model", "a", "--benchmarks", "reasoning_gym", "--chat-template", "--system-prompt", "Be brief."]
    cfg, reward_cfg = config_from_args(build_parser().parse_args([*chat, "--answer", "last_number"]))
    assert cfg.chat_template and cfg.system_prompt == "Be brief." and reward_cfg.answer == "last_number"
    with pytest.raises(EvalConfigError, match="--system-prompt: a system turn needs --chat-template"):
        config_from_args(build_parser().parse_args(["--model", "a", "--benchmarks", "gsm8k", "--system-prompt", "x"]))


def test_a_system_prompt_and_an_answer_format_enter_the_run_settings_only_when_set():
    from megatron_rlvr.eval.runner import run_settings

    plain = run_settings(EvalConfig(), "m")
    assert "system_prompt" not in plain and "answer" not in plain  # runs stored before both existed still match
    chat = run_settings(EvalConfig(chat_template=True, system_prompt=""), "m", "last_number")
    assert chat == {**plain, "chat_template": True, "system_prompt": "", "answer": "last_number"}


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
