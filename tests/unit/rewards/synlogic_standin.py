"""A stand-in checkout of github.com/MiniMax-AI/SynLogic with two tasks, in the repository's layout and interface:
``task2verifier.py`` at the root (prints its directory and puts it on sys.path, as the real one does) mapping task
names to verifier classes; ``base/data.py`` (``Data(question, answer, difficulty, metadata)``) and
``base/verifier.py``; ``games/tasks/<task>/scripts/<task>_verifier.py`` (namespace packages, no __init__.py).
The two verifiers are ours, written for the tests; like SynLogic's they print while they verify and accept
answers in any form that is right, not only the gold string's."""

from pathlib import Path

TASK2VERIFIER = """import os
import sys
print(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from games.tasks.word_sorting.scripts.word_sorting_verifier import WordSortingVerifier
from games.tasks.game_of_24.scripts.game_of_24_verifier import GameOf24Verifier

verifier_classes = {
    "game_of_24": GameOf24Verifier,
    "word_sorting": WordSortingVerifier,
}
"""

DATA = """class Data:
    def __init__(self, question: str, answer: str, difficulty: int = 1, metadata: dict = None, **kwargs):
        self.question = question
        self.answer = answer
        self.difficulty = difficulty
        self.metadata = metadata
"""

VERIFIER = """from abc import ABC, abstractmethod


class Verifier(ABC):
    @abstractmethod
    def verify(self, data, test_answer: str):
        raise NotImplementedError

    @abstractmethod
    def extract_answer(self, test_solution: str):
        raise NotImplementedError
"""

WORD_SORTING = '''import re

from base.verifier import Verifier


class WordSortingVerifier(Verifier):
    """Right when the answer lists the question's words in sorted order, whatever separates them."""

    def verify(self, data, test_solution):
        words = re.findall(r"[a-z]+", self.extract_answer(test_solution).lower())
        print("word_sorting: extracted", words)
        return words == sorted(data.metadata["words"])

    def extract_answer(self, test_solution):
        found = re.findall(r"<answer>(.*?)</answer>", test_solution, re.DOTALL)
        return found[-1] if found else ""
'''

GAME_OF_24 = '''import ast
import re
from collections import Counter
from fractions import Fraction

from base.verifier import Verifier

OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b}


def _value(node, used):
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_value(node.left, used), _value(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError("not arithmetic")


class GameOf24Verifier(Verifier):
    """Right when the answer is any expression over exactly the given numbers that equals the result."""

    def verify(self, data, test_solution):
        expression = self.extract_answer(test_solution)
        print("game_of_24: checking", expression)
        used = []
        try:
            value = _value(ast.parse(expression, mode="eval").body, used)
        except (SyntaxError, ValueError, ZeroDivisionError):
            return False
        return Counter(used) == Counter(data.metadata["numbers"]) and value == data.metadata["result"]

    def extract_answer(self, test_solution):
        found = re.findall(r"<answer>(.*?)</answer>", test_solution, re.DOTALL)
        return found[-1].strip() if found else ""
'''


def make_checkout(root: Path) -> Path:
    files = {
        "task2verifier.py": TASK2VERIFIER,
        "base/data.py": DATA,
        "base/verifier.py": VERIFIER,
        "games/tasks/word_sorting/scripts/word_sorting_verifier.py": WORD_SORTING,
        "games/tasks/game_of_24/scripts/game_of_24_verifier.py": GAME_OF_24,
        "requirements.txt": "numpy\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root
