"""Prompt datasets: file formats, bad rows, over-long prompts, the demo default, chat templates, resumable batches."""

from __future__ import annotations

import json
import logging

import pytest

from megatron_rlvr.data import DataConfig, DataError, PromptLoader, load_items


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from megatron_rlvr.demo import MODEL_DIR

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_become_items_with_string_and_dict_answers(tmp_path, tokenizer):
    f = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"problem": "1 2 3 4 -> 10:", "answer": {"numbers": [1, 2, 3, 4], "target": 10}},
            "",
            {"problem": "what is 2+2", "answer": "4", "task": "math", "id": "q7"},
        ],
    )
    items, stats = load_items(DataConfig(path=str(f)), tokenizer)
    assert stats.rows == 2 and stats.bad_rows == 0
    assert [i.id for i in items] == ["p.jsonl:1", "q7"]
    assert items[0].answer == {"numbers": [1, 2, 3, 4], "target": 10} and items[0].task == "countdown"
    assert items[1].answer == "4" and items[1].task == "math"
    assert tokenizer.decode(list(items[0].prompt_ids)) == "1 2 3 4 -> 10:"


def test_configurable_field_names_and_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["1 2 -> 3:", "4 5 -> 9:"], "ref": ["3", "9"]}), f)
    items, _ = load_items(DataConfig(path=str(f), problem_key="q", answer_key="ref", task="math"), tokenizer)
    assert [(i.id, i.answer, i.task) for i in items] == [("p.parquet:1", "3", "math"), ("p.parquet:2", "9", "math")]


def test_missing_answer_is_an_error_naming_file_and_line(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1 -> 1:", "answer": "1"}, {"problem": "2 -> 2:"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'answer'"):
        load_items(DataConfig(path=str(f)), tokenizer)


def test_bad_rows_are_counted_and_skipped_when_configured(tmp_path, tokenizer, caplog):
    f = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"problem": "1 -> 1:", "answer": "1"},
            {"problem": "2 -> 2:"},
            "{not json",
            {"answer": "3"},
            {"problem": "4 -> 4:", "answer": "4"},
        ],
    )
    with caplog.at_level(logging.WARNING):
        items, stats = load_items(DataConfig(path=str(f), skip_bad_rows=True), tokenizer)
    assert [i.id for i in items] == ["bad.jsonl:1", "bad.jsonl:5"]
    assert (stats.rows, stats.bad_rows) == (5, 3)
    assert "bad.jsonl:3: not valid JSON" in caplog.text


def test_invalid_json_is_an_error_naming_the_line(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "x.jsonl", [{"problem": "1 -> 1:", "answer": "1"}, "[1, 2]"])
    with pytest.raises(DataError, match=r"x\.jsonl:2: expected a JSON object"):
        load_items(DataConfig(path=str(f)), tokenizer)


def test_long_prompts_are_skipped_with_a_warning_not_truncated(tmp_path, tokenizer, caplog):
    f = write_jsonl(
        tmp_path / "l.jsonl",
        [
            {"problem": "1 2 -> 3:", "answer": "3"},
            {"problem": "1 2 3 4 5 6 7 8 9 -> 45:", "answer": "45"},
        ],
    )
    with caplog.at_level(logging.WARNING):
        items, stats = load_items(DataConfig(path=str(f), max_prompt_tokens=10), tokenizer)
    assert [i.id for i in items] == ["l.jsonl:1"] and stats.too_long == 1
    assert "l.jsonl:2" in caplog.text and "max_prompt_tokens=10" in caplog.text


def test_missing_file_and_unknown_format_are_named(tmp_path, tokenizer):
    with pytest.raises(DataError, match="nope.jsonl: not found"):
        load_items(DataConfig(path=str(tmp_path / "nope.jsonl")), tokenizer)
    (tmp_path / "p.csv").write_text("problem,answer\n")
    with pytest.raises(DataError, match="p.csv: unknown format"):
        load_items(DataConfig(path=str(tmp_path / "p.csv")), tokenizer)


def test_empty_path_gives_the_demo_task_with_disjoint_splits(tokenizer):
    cfg = DataConfig(demo_train_problems=200, demo_eval_problems=32)
    train, _ = load_items(cfg, tokenizer, "train")
    evals, _ = load_items(cfg, tokenizer, "eval")
    assert len(train) == 200 and len(evals) == 32
    assert not {i.id for i in train} & {i.id for i in evals}
    item = train[0]
    assert item.task == "countdown" and set(item.answer) == {"numbers", "target"}
    assert item.prompt == f"{' '.join(map(str, item.answer['numbers']))} -> {item.answer['target']}:"
    assert [i.id for i in load_items(cfg, tokenizer, "train")[0]] == [i.id for i in train]  # deterministic


def test_chat_template_wraps_the_problem(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1 2 -> 3:", "answer": "3"}])
    with pytest.raises(DataError, match="no chat template"):
        load_items(DataConfig(path=str(f), chat_template=True), tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    try:
        items, _ = load_items(DataConfig(path=str(f), chat_template=True), tokenizer)
    finally:
        tokenizer.chat_template = None
    assert items[0].prompt == "(1 2 -> 3:)>" and items[0].problem == "1 2 -> 3:"


def _items(n):
    from megatron_rlvr.data.dataset import PromptItem

    return [PromptItem(f"id{i}", str(i), (i,), str(i), "math") for i in range(n)]


def test_batches_cover_every_item_each_epoch_in_a_seeded_order():
    items = _items(10)
    loader = PromptLoader(items, batch_size=5, seed=3)
    epoch0 = [i.id for _ in range(2) for i in loader.next_batch()]
    epoch1 = [i.id for _ in range(2) for i in loader.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == sorted(i.id for i in items)
    assert epoch0 != epoch1  # reshuffled per epoch
    again = PromptLoader(items, batch_size=5, seed=3)
    assert [i.id for i in again.next_batch()] == epoch0[:5]
    assert [i.id for i in PromptLoader(items, 5, seed=4).next_batch()] != epoch0[:5]
    assert [i.id for i in PromptLoader(items, 5, seed=3, shuffle=False).next_batch()] == [f"id{i}" for i in range(5)]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5])
def test_resume_yields_exactly_the_batches_of_an_uninterrupted_run(stop_after):
    items = _items(7)  # 7 items, batches of 3: batches straddle epoch ends
    full = PromptLoader(items, 3, seed=11)
    expected = [[i.id for i in full.next_batch()] for _ in range(8)]

    first = PromptLoader(items, 3, seed=11)
    got = [[i.id for i in first.next_batch()] for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptLoader(items, 3, seed=11)
    resumed.load_state_dict(state)
    got += [[i.id for i in resumed.next_batch()] for _ in range(8 - stop_after)]
    assert got == expected


def test_resume_refuses_a_different_dataset_or_seed():
    state = PromptLoader(_items(7), 3, seed=11).state_dict()
    with pytest.raises(DataError, match="num_items=7"):
        PromptLoader(_items(8), 3, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match="seed=11"):
        PromptLoader(_items(7), 3, seed=12).load_state_dict(state)
