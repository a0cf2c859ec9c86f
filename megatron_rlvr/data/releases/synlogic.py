"""SynLogic (MiniMaxAI/SynLogic, ``synlogic_easy/train.parquet`` and ``synlogic_hard/train.parquet``): verl-style rows,
the question in ``prompt`` (chat messages), the task in ``data_source``, the answer in ``reward_model.ground_truth``
(or ``answer``) and the task's data in ``extra_info.game_data_str`` (the JSON of SynLogic's ``Data``: question,
answer, difficulty, metadata), which is what SynLogic's official verifiers read.

A row's reference keeps what those verifiers need: ``{"data_source", "answer", "metadata", "question",
"difficulty"}`` (the answer as released, also when it is not a string: a grid, a list). The reward routes it to the
task's official verifier with ``reward.synlogic_dir``, else to the generic matcher (``reward.logic_fallback``).
"""

from __future__ import annotations

import json

from megatron_rlvr.data.releases.base import Options, Prepared, Release, Skip, chat_text, first


def _game_data(record: dict) -> dict:
    extra = record.get("extra_info")
    game = extra.get("game_data_str") if isinstance(extra, dict) else None
    if isinstance(game, str):
        try:
            data = json.loads(game)
        except json.JSONDecodeError:
            raise Skip("extra_info.game_data_str is not valid JSON") from None
        if isinstance(data, dict):
            return data
    return {}


def _answer(record: dict, game: dict) -> object:
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") not in (None, ""):
        return reward_model["ground_truth"]
    if first(record, "answer") is not None:
        return record["answer"]
    return game.get("answer")


def convert(record: dict, options: Options) -> Prepared:
    problem = chat_text(first(record, "prompt", "question"))
    if not problem:
        raise Skip("no 'prompt' (chat messages or text) or 'question'")
    game = _game_data(record)
    answer = _answer(record, game)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise Skip("no answer ('reward_model.ground_truth', 'answer' or extra_info.game_data_str's 'answer')")
    task = first(record, "data_source")
    reference = {
        "data_source": task if isinstance(task, str) else None,
        "answer": answer.strip() if isinstance(answer, str) else answer,
        "metadata": game.get("metadata"),
        "question": game.get("question") if isinstance(game.get("question"), str) else problem,
        "difficulty": game.get("difficulty", 1),
    }
    rid = first(record, "id", "idx")
    return Prepared(problem, reference, "logic", problem, f"{task}/{rid}" if task and rid is not None else "")


SYNLOGIC = Release(
    "synlogic",
    convert,
    "SynLogic: 'prompt' (chat messages), 'data_source', 'reward_model.ground_truth' "
    "(or 'answer'), 'extra_info.game_data_str' (question, answer, difficulty, metadata); "
    "synlogic_{easy,hard}/train.parquet",
)
