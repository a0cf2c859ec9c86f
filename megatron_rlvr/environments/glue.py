"""The environment's tokens between two turns of the policy, made by the model's own chat template
(docs/multi-turn.md, "Token accounting").

With a chat template, the glue after a sampled turn is the template's text between the end of an assistant message
and the start of the next assistant message, with the observation as a message of ``environment.observation_role``
in between: rendered from a conversation of the template (a user turn, an assistant turn, the observation, the
generation prompt), cut after the assistant's content, and tokenised alone. The sampled turn already ends with the
end-of-turn token when it stopped there, so the glue's copy of it is dropped; the glue then starts at a special
token or a newline, a clean token boundary. Without a chat template, the glue is the observation on a line of its
own. Either way the ids are appended to the running ids as they are: nothing before them is ever re-tokenised.
"""

from __future__ import annotations

from typing import Any

_MARK = "\x00MARK\x00"  # an assistant content no template rewrites


class TurnGlue:
    def __init__(self, tokenizer: Any, role: str, observation_tokens: int, end_of_turn_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.role = role
        self.observation_tokens = observation_tokens
        self.end_of_turn_ids = tuple(end_of_turn_ids)
        self.templated = getattr(tokenizer, "chat_template", None) is not None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(self, observation: str) -> str:
        """The observation cut to ``environment.observation_tokens`` tokens."""
        ids = self._ids(observation)
        return (
            observation
            if len(ids) <= self.observation_tokens
            else self.tokenizer.decode(ids[: self.observation_tokens])
        )

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt when an environment's reset gives messages."""
        if not self.templated:
            return self._ids("\n".join(m["content"] for m in messages))
        return self._ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def observation(self, observation: str, sampled: list[int]) -> list[int]:
        """The ids after the sampled turn ``sampled`` that show ``observation`` and open the policy's next turn."""
        observation = self.cut(observation)
        if not self.templated:
            ended = self.tokenizer.decode(sampled[-1:]).endswith("\n") if sampled else True
            return self._ids(("" if ended else "\n") + observation + "\n")
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        before = self.tokenizer.apply_chat_template(base, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            base + [{"role": self.role, "content": observation}], tokenize=False, add_generation_prompt=True
        )
        cut = before.index(_MARK) + len(_MARK)
        if after[:cut] != before[:cut]:
            raise ValueError("the chat template renders an assistant turn differently once a message follows it")
        glue = after[cut:]
        if sampled and sampled[-1] in self.end_of_turn_ids:
            end = self.tokenizer.decode([sampled[-1]])
            if glue.startswith(end):
                glue = glue[len(end) :]
        return self._ids(glue)
