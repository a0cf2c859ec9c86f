"""Shared pieces of the multi-turn tests: a ChatML template for the byte-level test tokenizer, and the text of a
user-written environment file (written to a temporary path by each test that names it in a config)."""

from megatron_rlvr.testing.tiny_models import byte_level_tokenizer

# ChatML, with the tokenizer's EOS as the end of turn (as SmolLM2's and Qwen's templates end turns with a special token)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A user's environment: "call" turns get an observation and 0.25, anything else ends with 1.0. Problems named
# "hang" hang in step and "crash" kill their process, so the worker deadlines and crash handling can be seen.
USER_ENVIRONMENT = """
import os
import time

from megatron_rlvr.environments import Step


class Echo:
    def reset(self, problem):
        self.problem, self.turn = problem, 0
        return []

    def step(self, response):
        self.turn += 1
        if self.problem.id == "hang":
            time.sleep(3600)
        if self.problem.id == "crash":
            os._exit(3)
        if response.startswith("call"):
            return Step(f"obs{self.turn}", 0.25, False)
        return Step("", 1.0, True)


class ThreeTurns:  # any turn gets an observation and 0.25 until the third, which ends with 1.0

    def reset(self, problem):
        self.turn = 0
        return []

    def step(self, response):
        self.turn += 1
        return Step(f"obs{self.turn}", 1.0 if self.turn == 3 else 0.25, self.turn == 3)


NOT_CALLABLE = 3
"""


def chat_tokenizer():
    tok = byte_level_tokenizer()
    tok.chat_template = CHATML
    return tok


def write_user_environment(directory) -> str:
    path = directory / "my_env.py"
    path.write_text(USER_ENVIRONMENT)
    return str(path)
