"""How a prompt becomes the token ids an engine continues: the one encoding that training prompts (data/dataset.py),
in-training validation and evaluation (eval/api.py's encoder) share, so a model is asked the same way everywhere.

    encoded = encode_prompt(tokenizer, problem_text, chat_template=True, system_prompt=None)
    encoded.text, encoded.ids      # what the model continues, and its token ids
    end_of_turn_id(tokenizer)      # the token the template closes the assistant's answer with (ChatML: <|im_end|>)
    stop_ids(model_dir, chat)      # what an engine of that model stops at besides EOS: () or (end of turn,)

Nothing else in the package applies a chat template or chooses whether special tokens are added to a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rlvr.errors import UserError


class PromptTokenizer(Protocol):
    """What the encoding reads of a tokenizer (a Hugging Face tokenizer is one)."""

    chat_template: str | dict | None  # None: the tokenizer defines no chat template

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> Any: ...

    def __call__(self, text: str, *, add_special_tokens: bool) -> Mapping[str, Sequence[int]]: ...


class EndOfTurnTokenizer(PromptTokenizer, Protocol):
    """A prompt tokenizer that lists its special tokens' ids (a Hugging Face tokenizer does)."""

    all_special_ids: list[int]


class ChatTemplateMissing(UserError, ValueError):
    """A prompt was to be wrapped in the tokenizer's chat template, and the tokenizer defines none."""


class EndOfTurnUnknown(UserError, ValueError):
    """The chat template writes no special token right after the assistant's answer, so nothing marks its end."""


@dataclass(frozen=True)
class EncodedPrompt:
    text: str  # what the model continues: the problem text, or the chat-templated conversation
    ids: tuple[int, ...]  # its token ids, as the engine receives them


def has_chat_template(tokenizer: PromptTokenizer) -> bool:
    return bool(tokenizer.chat_template)


def encode_prompt(
    tokenizer: PromptTokenizer, problem: str, *, chat_template: bool, system_prompt: str | None = None
) -> EncodedPrompt:
    """The prompt the model is given for ``problem`` (the problem's text with its instruction, e.g. a benchmark's
    "put your final answer within \\boxed{}"), as text and token ids.

    ``chat_template=False`` (base models): the text is ``problem`` unchanged, and the ids are the tokenizer's
    encoding of it with the special tokens the tokenizer adds to any text (``add_special_tokens=True``: the BOS of
    a tokenizer that prepends one, e.g. Llama's; Qwen's adds none).

    ``chat_template=True`` (instruct models): the text is the tokenizer's chat template applied to a conversation of
    one user turn holding ``problem``. With ``system_prompt`` None there is no system turn, so the template's own
    default system prompt, when it has one, opens the conversation (ChatML templates such as Qwen2.5's and SmolLM2's
    write ``<|im_start|>system\\n...<|im_end|>``); a string (even empty) is the system turn's content instead, and
    replaces that default. Then comes the generation prompt, the opening of the assistant's turn (ChatML: ``<|im_start|>assistant\\n``), so
    the model's continuation is the assistant's answer. The ids are that text's encoding without added special
    tokens (``add_special_tokens=False``): the template writes every special token itself (its BOS, the
    ``<|im_start|>`` and ``<|im_end|>`` markers, which encode to their single special ids), and adding the
    tokenizer's BOS again would double it. The end-of-turn token after the answer (ChatML: ``<|im_end|>``) is the
    model's to generate; the engines stop at it (`end_of_turn_id`), and the response the actor trains on ends with
    it.

    Raises ChatTemplateMissing when ``chat_template`` is on and the tokenizer defines no chat template, and
    ValueError when a ``system_prompt`` is given without the chat template (a raw prompt has no system turn).
    """
    if chat_template:
        if not has_chat_template(tokenizer):
            raise ChatTemplateMissing("the tokenizer defines no chat template")
        system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        text = tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
        )
    elif system_prompt is not None:
        raise ValueError("a system prompt needs the chat template (a raw prompt has no system turn)")
    else:
        text = problem
    return EncodedPrompt(text, tuple(tokenizer(text, add_special_tokens=not chat_template)["input_ids"]))


_ANSWER_MARK = "\u2063answer\u2063"  # text no template writes, to find where the assistant's answer ends


def end_of_turn_id(tokenizer: EndOfTurnTokenizer) -> int:
    """The token id that the chat template writes right after an assistant's answer: the end of the turn, where
    sampling a chat prompt must stop (ChatML: ``<|im_end|>``; Llama 3: ``<|eot_id|>``; DeepSeek-R1's distills:
    ``<｜end▁of▁sentence｜>``). Found by rendering a conversation whose assistant turn holds a marker and reading
    the first token after the marker; it must be one of the tokenizer's special tokens, else EndOfTurnUnknown (a
    template that ends a turn with plain text, such as a newline, gives no token an engine could stop at)."""
    if not has_chat_template(tokenizer):
        raise ChatTemplateMissing("the tokenizer defines no chat template, so it has no end of turn")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANSWER_MARK}],
        tokenize=False,
        add_generation_prompt=False,
    )
    if _ANSWER_MARK not in text:
        raise EndOfTurnUnknown("the chat template does not write the assistant's answer back; no end of turn found")
    after = text[text.rindex(_ANSWER_MARK) + len(_ANSWER_MARK) :]
    ids = list(tokenizer(after, add_special_tokens=False)["input_ids"]) if after else []
    if not ids or ids[0] not in set(tokenizer.all_special_ids):
        raise EndOfTurnUnknown(
            f"the chat template writes {after[:20]!r} after the assistant's answer, not a special token; "
            "no end-of-turn token to stop sampling at"
        )
    return int(ids[0])


def stop_ids(model_dir: str, chat_template: bool) -> tuple[int, ...]:
    """The token ids an engine serving ``model_dir`` stops at besides EOS: under the chat template its end of turn
    (`end_of_turn_id` of the model's tokenizer), else none."""
    if not chat_template:
        return ()
    from transformers import AutoTokenizer

    return (end_of_turn_id(AutoTokenizer.from_pretrained(model_dir)),)
