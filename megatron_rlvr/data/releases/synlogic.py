"""SynLogic (MiniMaxAI/SynLogic, ``synlogic_easy/train.parquet`` and ``synlogic_hard/train.parquet``): verl-style rows,
the question in ``prompt`` (chat messages) and the answer in ``reward_model.ground_truth`` (or ``answer``, or the
``answer`` of the JSON in ``extra_info.game_data_str``). Rows whose answer is not a plain string (tasks that need
SynLogic's own per-task verifier, e.g. a grid) are skipped: the logic verifier compares strings."""

from __future__ import annotations

import json

from megatron_rlvr.data.releases.base import Options, Prepared, Release, Skip, chat_text, first


def _answer(record: dict) -> object:
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") not in (None, ""):
        return reward_model["ground_truth"]
    if first(record, "answer") is not None:
        return record["answer"]
    extra = record.get("extra_info")
    game = extra.get("game_data_str") if isinstance(extra, dict) else None
    if isinstance(game, str):
        try:
            return json.loads(game).get("answer")
        except (json.JSONDecodeError, AttributeError):
            return None
    return None


def convert(record: dict, options: Options) -> Prepared:
    problem = chat_text(first(record, "prompt", "question"))
    if not problem:
        raise Skip("no 'prompt' (chat messages or text) or 'question'")
    answer = _answer(record)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise Skip("no answer ('reward_model.ground_truth', 'answer' or extra_info.game_data_str's 'answer')")
    if not isinstance(answer, str):
        raise Skip(f"answer is a {type(answer).__name__}, not a string (needs SynLogic's own verifier)")
    task = first(record, "data_source")
    rid = first(record, "id", "idx")
    return Prepared(problem, answer.strip(), "logic", problem, f"{task}/{rid}" if task and rid is not None else "")


SYNLOGIC = Release("synlogic", convert, "SynLogic: 'prompt' (chat messages), 'reward_model.ground_truth' (or 'answer', "
                   "or extra_info.game_data_str's 'answer'), 'data_source'; synlogic_{easy,hard}/train.parquet")
