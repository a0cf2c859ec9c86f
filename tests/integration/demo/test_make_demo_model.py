"""tools/reports/make_demo_model.py end to end at a toy size: the files it writes load back as the same tokenizer and model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "tools" / "reports" / "make_demo_model.py"


def _tool():
    spec = importlib.util.spec_from_file_location("make_demo_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tool_writes_a_checkpoint_whose_tokenizer_survives_autotokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.tasks import countdown as task

    out = tmp_path / "model"
    assert (
        _tool().main(
            [
                "--out",
                str(out),
                "--steps",
                "3",
                "--train-problems",
                "60",
                "--eval-problems",
                "2",
                "--eval-samples",
                "2",
                "--layers",
                "2",
            ]
        )
        == 0
    )
    info = json.loads((out / "training_info.json").read_text())
    assert info["vocab_size"] % 8 == 0 and set(info["base_eval"]) >= {"pass@1", "pass@2"}
    tok = AutoTokenizer.from_pretrained(out)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # what transformers (and so vLLM) forces on a qwen2 checkpoint
    p = task.generate(0, 1, "eval")[0]
    text = p.prompt + task.solutions(p.numbers, p.target)[0]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == info["vocab_size"] >= len(tok)

    # continuing from it keeps the tokenizer and shape
    out2 = tmp_path / "model2"
    assert (
        _tool().main(
            [
                "--init-from",
                str(out),
                "--out",
                str(out2),
                "--seed",
                "1",
                "--steps",
                "2",
                "--train-problems",
                "30",
                "--eval-problems",
                "1",
                "--eval-samples",
                "2",
            ]
        )
        == 0
    )
    assert (out2 / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert json.loads((out2 / "training_info.json").read_text())["continued_from"]["args"]["layers"] == 2


@pytest.mark.slow
def test_weak_preset_builds_a_smaller_model_on_the_demo_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.rollout.prefixes import check_prefix_model

    demo = TOOL.parents[2] / "megatron_rlvr" / "demo" / "model"
    out = tmp_path / "weak"
    # --out and the size flags beside --weak override its preset; the tokenizer still comes from the demo model
    assert (
        _tool().main(
            [
                "--weak",
                "--out",
                str(out),
                "--steps",
                "3",
                "--train-problems",
                "30",
                "--eval-problems",
                "1",
                "--eval-samples",
                "2",
                "--layers",
                "1",
            ]
        )
        == 0
    )
    info = json.loads((out / "training_info.json").read_text())
    assert info["args"]["tokenizer_from"] == "megatron_rlvr/demo/model" and info["args"]["hidden"] == 64
    assert (out / "tokenizer.json").read_text() == (demo / "tokenizer.json").read_text()
    weak, base = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(demo)
    assert weak.config.vocab_size == base.config.vocab_size and weak.config.num_hidden_layers == 1
    assert weak.num_parameters() < base.num_parameters()
    check_prefix_model(demo, out)  # what make_engine checks before serving it as rollout.prefix_model


def test_committed_weak_model_shares_the_demo_tokenizer_and_is_smaller():
    from megatron_rlvr.rollout.prefixes import check_prefix_model

    demo = TOOL.parents[2] / "megatron_rlvr" / "demo"
    check_prefix_model(demo / "model", demo / "weak_model")
    weak, base = (json.loads((demo / d / "training_info.json").read_text()) for d in ("weak_model", "model"))
    assert weak["parameters"] < base["parameters"]
    assert weak["base_eval"]["pass@1"] < base["base_eval"]["pass@1"]  # measured when each was made (same eval set)
