"""How a prompt becomes the token ids an engine continues: the one encoding that training prompts (data/dataset.py),
in-training validation and evaluation (eval/api.py's encoder) share, so a model is asked the same way everywhere.

    encoded = encode_prompt(tokenizer, problem_text, chat_template=True)
    encoded.text, encoded.ids      # what the model continues, and its token ids

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


class ChatTemplateMissing(UserError, ValueError):
    """A prompt was to be wrapped in the tokenizer's chat template, and the tokenizer defines none."""


@dataclass(frozen=True)
class EncodedPrompt:
    text: str  # what the model continues: the problem text, or the chat-templated conversation
    ids: tuple[int, ...]  # its token ids, as the engine receives them


def has_chat_template(tokenizer: PromptTokenizer) -> bool:
    return bool(tokenizer.chat_template)


def encode_prompt(tokenizer: PromptTokenizer, problem: str, *, chat_template: bool) -> EncodedPrompt:
    """The prompt the model is given for ``problem`` (the problem's text with its instruction, e.g. a benchmark's
    "put your final answer within \\boxed{}"), as text and token ids.

    ``chat_template=False`` (base models): the text is ``problem`` unchanged, and the ids are the tokenizer's
    encoding of it with the special tokens the tokenizer adds to any text (``add_special_tokens=True``: the BOS of
    a tokenizer that prepends one, e.g. Llama's; Qwen's adds none).

    ``chat_template=True`` (instruct models): the text is the tokenizer's chat template applied to a conversation of
    one user turn holding ``problem``, with no system turn, so the template's own default system prompt, when it
    has one, opens the conversation (ChatML templates such as Qwen2.5's write ``<|im_start|>system\\n...<|im_end|>``),
    and with the generation prompt, the opening of the assistant's turn (ChatML: ``<|im_start|>assistant\\n``), so
    the model's continuation is the assistant's answer. The ids are that text's encoding without added special
    tokens (``add_special_tokens=False``): the template writes every special token itself (its BOS, the
    ``<|im_start|>`` and ``<|im_end|>`` markers, which encode to their single special ids), and adding the
    tokenizer's BOS again would double it. The end-of-turn token after the answer (ChatML: ``<|im_end|>``) is the
    model's to generate; where sampling stops is the engine's EOS and stop settings, not this function's.

    Raises ChatTemplateMissing when ``chat_template`` is on and the tokenizer defines no chat template.
    """
    if chat_template:
        if not has_chat_template(tokenizer):
            raise ChatTemplateMissing("the tokenizer defines no chat template")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = problem
    return EncodedPrompt(text, tuple(tokenizer(text, add_special_tokens=not chat_template)["input_ids"]))
