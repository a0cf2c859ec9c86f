"""Validation's held-out prompts (benchmarks or the eval split) and its pass@k figures. The validation run inside
training (metrics, entropy histograms) is tested end to end in test_trainer.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rlvr.config import load_config
from megatron_rlvr.experience.validation import load_validation_items, pass_at_k_metrics

DEMO_MODEL = "megatron_rlvr/demo/model"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def test_pass_at_k_metrics_average_the_unbiased_estimator_over_prompts():
    got = pass_at_k_metrics(np.array([0, 1, 2]), n_samples=2)
    assert got == pytest.approx({"val/pass@1": (0 + 0.5 + 1) / 3, "val/pass@2": (0 + 1 + 1) / 3})
    ks = list(pass_at_k_metrics(np.array([3]), n_samples=6))
    assert ks == ["val/pass@1", "val/pass@2", "val/pass@4", "val/pass@6"]


def test_eval_split_of_the_demo_task_capped_by_eval_limit(tokenizer):
    cfg = load_config(None, [f"model.hf_dir={DEMO_MODEL}", "eval.limit=5", "data.demo_eval_problems=12"])
    items = load_validation_items(cfg, tokenizer)
    assert len(items) == 5 and all(i.task == "countdown" and i.prompt_ids for i in items)
    whole_split = {i.id for i in load_validation_items(load_config(None, ["data.demo_eval_problems=12"]), tokenizer)}
    assert {i.id for i in items} <= whole_split  # the same split, the first eval.limit of it


def test_benchmark_files_become_prompt_items_with_benchmark_ids(tokenizer, tmp_path):
    rows = [{"id": f"p{i}", "numbers": [1, 2, 3, 4], "target": 10 + i} for i in range(3)]
    (tmp_path / "countdown.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["eval.benchmarks=[countdown]", f"eval.data_dir={tmp_path}", "data.max_prompt_tokens=64"])
    items = load_validation_items(cfg, tokenizer)
    assert [i.id for i in items] == ["countdown/p0", "countdown/p1", "countdown/p2"]
    assert items[1].answer == {"numbers": [1, 2, 3, 4], "target": 11}
    assert items[0].prompt_ids == tuple(tokenizer(items[0].prompt)["input_ids"])


def test_benchmark_prompts_that_fit_nowhere_are_an_error(tokenizer, tmp_path):
    (tmp_path / "countdown.jsonl").write_text(json.dumps({"id": "a", "numbers": [1, 2], "target": 3}) + "\n")
    cfg = load_config(None, ["eval.benchmarks=[countdown]", f"eval.data_dir={tmp_path}", "data.max_prompt_tokens=2"])
    with pytest.raises(ValueError, match="no prompt fits data.max_prompt_tokens=2"):
        load_validation_items(cfg, tokenizer)
